"""per_sample_grad_norm for Conv1d/Conv2d/Conv3d weights: vmap's grouped convolution_backward over the
samples, its norm from the inputs and output gradients, its clipped sum as one weight gradient."""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from optpass.passes.per_sample_grad_norm.candidate import _Candidate, _coef_column, _shape

aten = torch.ops.aten


def _conv_candidate(step, node: torch.fx.Node, materialize: str = "auto") -> _Candidate | None:
    """``view(getitem(convolution_backward(g, x, w, .., groups, [.., True, ..]), 1), [B, out, in/groups, *k])``:
    vmap's batched weight gradient of a convolution, ONE grouped convolution_backward with
    x [N, B·in, *S], g [N, B·out, *S'] and groups = B·groups (sample b owns channel blocks b)."""
    if node.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return None
    item = node.args[0]
    if not (isinstance(item, torch.fx.Node) and item.target is operator.getitem
            and item.args[1] == 1 and isinstance(item.args[0], torch.fx.Node)
            and item.args[0].target is aten.convolution_backward.default):
        return None
    backward = item.args[0]
    g, x, _, _, stride, padding, dilation, transposed, output_padding, all_groups = backward.args[:10]
    shape, flat, x_shape, g_shape = _shape(node), _shape(item), _shape(x), _shape(g)
    if None in (shape, flat, x_shape, g_shape) or len(shape) != len(flat) + 1 or len(flat) < 3:
        return None
    batch, out_channels, in_per_group, kernel = shape[0], shape[1], shape[2], shape[3:]
    sizes = [*shape, *flat, *x_shape, *g_shape, all_groups]
    if transposed or any(output_padding):
        return None                                              # ConvTranspose: not this batched form
    # vmap specializes a convolution's batch and image sizes (torch 2.13): symbolic ones are not met
    if not all(isinstance(v, int) for v in sizes) or flat != [batch * out_channels, in_per_group, *kernel] \
            or all_groups % batch or x_shape[1] % batch or g_shape[1] != batch * out_channels \
            or x_shape[0] != g_shape[0]:
        return None
    groups, in_channels = all_groups // batch, x_shape[1] // batch
    if in_channels != in_per_group * groups or out_channels % groups:
        return None
    emit = step.emit
    spatial = len(kernel)
    labels = [("b",), ("r",), ("c",)] + [(f"k{d}",) for d in range(spatial)]
    size_of = {"b": batch, "r": out_channels, "c": in_per_group, **{f"k{d}": k for d, k in enumerate(kernel)}}
    what = f"Conv{spatial}d per-sample gradient [B={batch}, {', '.join(map(str, shape[1:]))}]"
    keep = _keep_materialized(x_shape, g_shape, batch, shape[1:], materialize)
    rows = x_shape[0]

    def per_sample(tensor, channels):
        """[N, B·C, *S] as [B, N, C, *S] (a view for N = 1)."""
        split = emit(aten.view.default, tensor, [rows, batch, channels, *_shape(tensor)[2:]])
        return emit(aten.permute.default, split, [1, 0, *range(2, 3 + spatial)])

    def norm(_):
        return emit(torch.ops.optpass.conv_per_sample_grad_sq_norm.default, per_sample(x, in_channels),
                    per_sample(g, out_channels), kernel, stride, padding, dilation, groups, "auto")

    def clipped_sum(coef, _):
        """sum_b coef_b P_b [out, in/groups, *k]: ONE weight gradient of the convolution over the B·N
        rows, each sample's output gradient scaled by its clip factor."""
        c = _coef_column(emit, coef, batch)
        c = emit(aten.view.default, c, [batch] + [1] * (2 + spatial))
        if c.meta["val"].dtype != g.meta["val"].dtype:
            c = emit(aten._to_copy.default, c, dtype=g.meta["val"].dtype)
        scaled = emit(aten.mul.Tensor, per_sample(g, out_channels), c)                 # [B, N, out, *S']
        scaled = emit(aten.reshape.default, scaled, [batch * rows, out_channels, *g_shape[2:]])
        inputs = emit(aten.reshape.default, per_sample(x, in_channels), [batch * rows, in_channels, *x_shape[2:]])
        weight = emit(aten.expand.default, emit(aten.new_empty.default, inputs, []),
                      [out_channels, in_per_group, *kernel])
        total = emit(aten.convolution_backward.default, scaled, inputs, weight, None, stride, padding, dilation,
                     False, output_padding, groups, [False, True, False])
        return emit(operator.getitem, total, 1)

    return _Candidate(what=what, root=node, labels=labels, size_of=size_of, norm=norm, clipped_sum=clipped_sum,
                      keep=keep, uses=(("Conv", x, g),))


def _keep_materialized(x_shape, g_shape, batch, weight_shape, materialize: str) -> str | None:
    """dp_materialize='auto': why a convolution's per-sample gradient is better left as it is, or None.
    The rewrite keeps the layer's input [N, in, *S] and output gradient [N, out, *S'] per sample alive
    until the clip factors are known and pays one more weight gradient; the per-sample gradient costs
    out·in/groups·prod(k) per sample and vmap computes it anyway. An early layer of a CNN (few channels,
    a large image) has a per-sample gradient far smaller than its activations: kept."""
    if materialize != "auto":
        return None
    kept = (math.prod(x_shape) + math.prod(g_shape)) // batch
    materialized = math.prod(weight_shape)
    if kept < materialized:
        return None
    return (f"kept materialized (dp_materialize='auto'): per sample, the weight's {materialized} elements are "
            f"no more than the {kept} of the input and output gradient that the rewrite keeps until the clip "
            "factors are known, and it saves one weight gradient; options={'dp_materialize': 'never'} "
            "rewrites it anyway")
