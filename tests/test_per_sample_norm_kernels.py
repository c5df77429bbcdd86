"""Per-sample gradient-norm kernels: the Triton kernels (CPU, interpreter) and the optpass:: custom ops.

Reference everywhere: n_i = ||G_i^T X_i||_F^2 = einsum("bto,bti->boi", g, x).pow(2).sum((1, 2));
for Embedding weights the materialized [B, vocab, d] per-sample gradients, squared and summed.
"""

import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optpass.kernels import embedding_norm as en
from optpass.kernels import per_sample_norm as psn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_sq_norm(x, g):
    """fp32 (fp64 for fp64 inputs) einsum reference, computed from the inputs as given (bf16-cast included)."""
    if x.dim() == 2:
        x, g = x.unsqueeze(1), g.unsqueeze(1)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.einsum("bto,bti->boi", g.to(dtype), x.to(dtype)).pow(2).sum((1, 2))


def max_rel_err(result, ref):
    return ((result.double() - ref.double()).abs() / ref.double().abs()).max().item()


def make_inputs(B, T, IN, OUT, dtype=torch.float32, seed=0, noncontiguous=False):
    gen = torch.Generator().manual_seed(seed)
    shape_x = (B, IN) if T is None else (B, T, IN)
    shape_g = (B, OUT) if T is None else (B, T, OUT)
    if noncontiguous:  # stored [B, in, T], viewed [B, T, in]: the kernels must follow strides
        x = torch.randn(B, IN, T, generator=gen).to(dtype).transpose(1, 2)
        g = torch.randn(B, OUT, T, generator=gen).to(dtype).transpose(1, 2)
        return x, g
    return torch.randn(shape_x, generator=gen).to(dtype), torch.randn(shape_g, generator=gen).to(dtype)


# ----------------------------------------------------------------------------
# Triton kernels on CPU under TRITON_INTERPRET=1 (one subprocess for all cases:
# the variable must be set before triton is imported, and the import is slow).
# ----------------------------------------------------------------------------

SMALL_DIRECT = dict(block_t=16, block_out=16, block_in=16)
SMALL_GHOST = dict(block_t=16, block_k=16)

# name: (B, T or None for 2-D, in, out, dtype, method, blocks, noncontiguous)
INTERPRETER_CASES = {
    "direct_fp32_ragged": (3, 7, 19, 13, "float32", "direct", SMALL_DIRECT, False),
    "ghost_fp32_ragged": (3, 7, 19, 13, "float32", "ghost", SMALL_GHOST, False),
    "direct_bf16_ragged": (3, 7, 19, 13, "bfloat16", "direct", SMALL_DIRECT, False),
    "ghost_bf16_ragged": (3, 7, 19, 13, "bfloat16", "ghost", SMALL_GHOST, False),
    # B = 1, several T steps / (out, in) tiles / a 3x3 grid of Gram tiles (symmetry weights)
    "direct_fp32_b1_multitile": (1, 40, 33, 50, "float32", "direct", SMALL_DIRECT, False),
    "ghost_fp32_b1_multitile": (1, 40, 33, 50, "float32", "ghost", SMALL_GHOST, False),
    "direct_bf16_b1_multitile": (1, 40, 33, 50, "bfloat16", "direct", SMALL_DIRECT, False),
    "ghost_bf16_b1_multitile": (1, 40, 33, 50, "bfloat16", "ghost", SMALL_GHOST, False),
    # 2-D inputs (T = 1)
    "direct_fp32_2d": (5, None, 24, 17, "float32", "direct", SMALL_DIRECT, False),
    "ghost_fp32_2d": (5, None, 24, 17, "float32", "ghost", SMALL_GHOST, False),
    "direct_bf16_2d": (5, None, 24, 17, "bfloat16", "direct", SMALL_DIRECT, False),
    # exact multiples of the blocks (no masking in play)
    "direct_fp32_exact": (2, 32, 32, 16, "float32", "direct", SMALL_DIRECT, False),
    "ghost_fp32_exact": (2, 32, 32, 16, "float32", "ghost", SMALL_GHOST, False),
    # strided (non-contiguous) inputs
    "direct_fp32_strided": (2, 9, 20, 18, "float32", "direct", SMALL_DIRECT, True),
    "ghost_fp32_strided": (2, 9, 20, 18, "float32", "ghost", SMALL_GHOST, True),
    # default block sizes through method="auto": 2*9^2 <= 70*65 -> ghost; 2*40^2 > 20*30 -> direct
    "auto_is_ghost_default_blocks": (2, 9, 70, 65, "float32", "auto", {}, False),
    "auto_is_direct_default_blocks": (2, 40, 20, 30, "float32", "auto", {}, False),
}

_SUBPROCESS = textwrap.dedent("""
    import os, sys, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from optpass.kernels.per_sample_norm import triton_per_sample_grad_sq_norm
    cases = torch.load(sys.argv[1])
    results = {name: triton_per_sample_grad_sq_norm(c["x"], c["g"], c["method"], **c["blocks"])
               for name, c in cases.items()}
    torch.save(results, sys.argv[2])
""")


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton_interpret")
    cases = {}
    for seed, (name, (B, T, IN, OUT, dtype, method, blocks, noncontig)) in enumerate(INTERPRETER_CASES.items()):
        x, g = make_inputs(B, T, IN, OUT, getattr(torch, dtype), seed, noncontig)
        cases[name] = dict(x=x, g=g, method=method, blocks=blocks)
    torch.save(cases, tmp / "cases.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS, str(tmp / "cases.pt"), str(tmp / "results.pt")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"interpreter subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return cases, torch.load(tmp / "results.pt")


@pytest.mark.parametrize("name", list(INTERPRETER_CASES))
def test_triton_kernel_matches_einsum_under_interpreter(interpreter_results, name):
    cases, results = interpreter_results
    case, result = cases[name], results[name]
    assert result.dtype == torch.float32 and result.shape == (case["x"].shape[0],)
    tol = 2e-2 if case["x"].dtype == torch.bfloat16 else 1e-4
    err = max_rel_err(result, reference_sq_norm(case["x"], case["g"]))
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"


def test_triton_kernels_compile_for_sm90_without_a_gpu():
    """The CUDA path cannot run here; compiling both kernels to cubin for an H100 target at least checks
    that the compiled (non-interpreted) kernels are valid Triton, and that bf16 tiles reach tensor cores."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("kernels are interpreted in this process")
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from optpass.kernels import _triton_per_sample_norm as kernels

    common = dict(x_ptr=None, g_ptr=None, partial_ptr="*fp32", T="i32", IN="i32", OUT="i32",
                  stride_xb="i32", stride_xt="i32", stride_xi="i32", stride_gb="i32", stride_gt="i32", stride_go="i32")
    direct = dict(common, n_tiles_in="i32", n_tiles="i32")
    ghost = dict(common, n_tiles_t="i32")
    specs = [(kernels._direct_sq_norm_kernel, direct, dict(BLOCK_T=32, BLOCK_OUT=64, BLOCK_IN=64)),
             (kernels._ghost_sq_norm_kernel, ghost, dict(BLOCK_T=64, BLOCK_K=32))]
    for fn, signature, blocks in specs:
        for ptr in ("*fp32", "*bf16"):
            constexprs = dict(blocks, INPUT_PRECISION="ieee", UPCAST=False)
            sig = dict(signature, x_ptr=ptr, g_ptr=ptr, **{k: "constexpr" for k in constexprs})
            try:
                compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs),
                                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
            except (ImportError, FileNotFoundError, RuntimeError) as e:  # no NVIDIA backend / ptxas in this wheel
                if "ptxas" in str(e) or isinstance(e, (ImportError, FileNotFoundError)):
                    pytest.skip(f"cannot compile for CUDA here: {e}")
                raise
            assert "cubin" in compiled.asm
            if ptr == "*bf16":
                assert "mma" in compiled.asm["ptx"], f"{fn.__name__}: bf16 dot does not use tensor cores"
            assert "atom" not in compiled.asm["ptx"], f"{fn.__name__}: uses atomics"


# ----------------------------------------------------------------------------
# the plain-torch CPU op
# ----------------------------------------------------------------------------

OP = torch.ops.optpass.per_sample_grad_sq_norm

SHAPES = {"3d_ragged": (3, 7, 19, 13), "b1": (1, 12, 8, 5), "2d": (4, None, 9, 6), "long_t": (2, 30, 4, 5)}


@pytest.mark.parametrize("method", psn.METHODS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_op_matches_einsum(method, shape, dtype):
    x, g = make_inputs(*SHAPES[shape], dtype=dtype)
    result = OP(x, g, method)
    assert result.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert result.shape == (x.shape[0],)
    assert max_rel_err(result, reference_sq_norm(x, g)) <= (1e-12 if dtype == torch.float64 else 1e-5)


def test_cpu_op_refuses_unknown_method_and_mismatched_shapes():
    x, g = make_inputs(2, 3, 4, 5)
    with pytest.raises(ValueError, match="method must be one of"):
        OP(x, g, "fast")
    with pytest.raises(ValueError, match="disagree"):
        OP(x, g[:, :2], "direct")
    with pytest.raises(ValueError, match="must both be"):
        OP(x, g[:, 0], "direct")


def test_cpu_op_handles_empty_batch_and_empty_sequence():
    for B, T in [(0, 3), (2, 0)]:
        x, g = torch.randn(B, T, 4), torch.randn(B, T, 5)
        for method in psn.METHODS:
            assert torch.equal(OP(x, g, method), torch.zeros(B))


@pytest.mark.parametrize("T, in_features, out_features, expected", [
    (4, 4, 8, "ghost"),     # 2*16 = 32 = in*out: ghost at the boundary
    (4, 3, 11, "ghost"),    # 32 <= 33
    (4, 31, 1, "direct"),   # 32 > 31
    (1, 1, 2, "ghost"),     # T = 1 (2-D inputs) on any real layer
    (2048, 1280, 5120, "direct"),
    (128, 1280, 5120, "ghost"),
])
def test_choose_norm_method_picks_ghost_iff_2t2_le_in_out(T, in_features, out_features, expected):
    assert psn.choose_norm_method(T, in_features, out_features) == expected


@pytest.mark.parametrize("shape", [(2, 4, 3, 11), (2, 4, 31, 1)])
def test_auto_runs_the_chosen_method(shape):
    x, g = make_inputs(*shape)
    chosen = psn.choose_norm_method(shape[1], shape[2], shape[3])
    assert torch.equal(OP(x, g, "auto"), OP(x, g, chosen))


@pytest.mark.parametrize("method", ["direct", "ghost"])
def test_cpu_op_chunked_by_samples_gives_identical_results(method, monkeypatch):
    x, g = make_inputs(7, 6, 10, 9)
    full = OP(x, g, method)
    # room for two samples' inputs + temporaries, so the batch runs in chunks of whole samples
    monkeypatch.setattr(psn, "CPU_CHUNK_BYTES", 2 * 4 * (6 * 19 + 2 * 9 * 10 + 3 * 6 * 6))
    assert torch.equal(OP(x, g, method), full)


@pytest.mark.parametrize("method", ["direct", "ghost"])
def test_cpu_op_with_tiny_budget_splits_one_sample_and_still_matches(method, monkeypatch):
    x, g = make_inputs(3, 6, 10, 9)
    full = OP(x, g, method)
    monkeypatch.setattr(psn, "CPU_CHUNK_BYTES", 1)  # one sample at a time, one row block at a time
    assert torch.allclose(OP(x, g, method), full, rtol=1e-6, atol=0)


class PeakBytes(TorchDispatchMode):
    """Peak of the bytes held by tensors that aten ops allocated while the mode was on (views not counted)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _release(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        if not func.is_view:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                # in-place and out= results are their input again: not an allocation
                if isinstance(t, torch.Tensor) and t._base is None and t.untyped_storage().data_ptr() not in inputs:
                    nbytes = t.untyped_storage().nbytes()
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._release, nbytes)
        return out


@pytest.mark.parametrize("method", ["direct", "ghost"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_op_temporaries_stay_within_the_budget(method, dtype, monkeypatch):
    B, T, IN, OUT = 16, 48, 64, 80
    x, g = make_inputs(B, T, IN, OUT, dtype=dtype)
    unbounded = B * (OUT * IN if method == "direct" else 2 * T * T) * 4  # what one bmm over the batch would hold
    budget = 32 * 1024  # one sample's fp32 inputs (27 KiB) + a few row blocks
    assert unbounded > 8 * budget
    monkeypatch.setattr(psn, "CPU_CHUNK_BYTES", budget)
    with PeakBytes() as mem:
        result = psn._torch_sq_norm(x, g, method)
    del result
    # the [B] result and a [chunk] accumulator are the only allowed extras
    assert 0 < mem.peak <= budget + 2 * 4 * B, f"peak {mem.peak} bytes > budget {budget}"


@pytest.mark.parametrize("method", ["direct", "ghost"])
@pytest.mark.parametrize("two_d", [False, True])
def test_opcheck(method, two_d):
    x, g = make_inputs(3, None if two_d else 5, 6, 7)
    torch.library.opcheck(OP, (x, g, method))
    torch.library.opcheck(OP, (x.requires_grad_(), g.requires_grad_(), method))
    grad = torch.randn(3)
    torch.library.opcheck(torch.ops.optpass.per_sample_grad_sq_norm_backward, (grad, x.detach(), g.detach(), method))


@pytest.mark.parametrize("method", psn.METHODS)
def test_gradients_match_einsum(method):
    x, g = make_inputs(3, 5, 6, 7, dtype=torch.float64)
    x.requires_grad_(), g.requires_grad_()
    weights = torch.randn(3, dtype=torch.float64)
    ours = torch.autograd.grad((OP(x, g, method) * weights).sum(), [x, g])
    ref = torch.autograd.grad((reference_sq_norm(x, g) * weights).sum(), [x, g])
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_op_under_torch_compile_on_cpu(backend, dynamic):
    """An opaque custom_op never routes CPU tensors into Triton (no '0 active drivers', docs/design.md §30)."""
    from torch._dynamo.utils import counters

    def clip_coefficients(x, g):
        norms = torch.ops.optpass.per_sample_grad_sq_norm(x * 1.0, g, "auto").sqrt()
        return (1.0 / (norms + 1e-6)).clamp(max=1.0)

    compiled = torch.compile(clip_coefficients, backend=backend, fullgraph=True, dynamic=dynamic)
    for B in (3, 5):
        x, g = make_inputs(B, 7, 19, 13)
        torch.testing.assert_close(compiled(x, g), clip_coefficients(x, g), rtol=1e-5, atol=0)
    assert counters["stats"]["unique_graphs"] >= 1


def test_gradient_through_compiled_op():
    def loss(x, g):
        return torch.ops.optpass.per_sample_grad_sq_norm(x, g, "ghost").sum()

    x, g = make_inputs(2, 5, 6, 7)
    x.requires_grad_(), g.requires_grad_()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    ours = torch.autograd.grad(compiled(x, g), [x, g])
    ref = torch.autograd.grad(reference_sq_norm(x, g).sum(), [x, g])
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# book-keeping: the clipped sum as one GEMM
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("T", [6, None])
def test_per_sample_clipped_weight_grad_equals_einsum(T):
    x, g = make_inputs(4, T, 9, 5)
    coef = torch.rand(4)
    x3, g3 = (x, g) if T is not None else (x.unsqueeze(1), g.unsqueeze(1))
    torch.testing.assert_close(psn.per_sample_clipped_weight_grad(x, g, coef),
                               torch.einsum("b,bto,bti->oi", coef, g3, x3), rtol=1e-5, atol=1e-5)


def test_per_sample_clipped_weight_grad_is_one_mm():
    from torch.utils.flop_counter import FlopCounterMode

    x, g = make_inputs(4, 6, 9, 5)
    with FlopCounterMode(display=False) as flops:
        psn.per_sample_clipped_weight_grad(x, g, torch.rand(4))
    counts = flops.get_flop_counts()["Global"]
    assert set(counts) == {torch.ops.aten.mm}
    assert counts[torch.ops.aten.mm] == 2 * 4 * 6 * 9 * 5


# ----------------------------------------------------------------------------
# Embedding weights: optpass::embedding_per_sample_grad_sq_norm (ghost / segment)
# ----------------------------------------------------------------------------

EMB_OP = torch.ops.optpass.embedding_per_sample_grad_sq_norm


def embedding_inputs(B, T, D, vocab=5, dtype=torch.float32, seed=0):
    """Few distinct ids (vocab 5) so that tokens repeat inside a sample."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=gen), torch.randn(B, T, D, generator=gen).to(dtype)


def materialized_embedding_grads(ids, g, vocab, padding_idx=-1):
    """[B, vocab, d] per-sample gradients sum_t onehot(ids_bt) g_btᵀ, padding rows 0 (fp32/fp64)."""
    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    onehot = torch.nn.functional.one_hot(ids, vocab).to(dtype)
    if padding_idx >= 0:
        onehot[..., padding_idx] = 0
    return torch.einsum("btv,btd->bvd", onehot, g.to(dtype))


@pytest.mark.parametrize("method", en.METHODS)
@pytest.mark.parametrize("padding_idx", [-1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_embedding_op_matches_materialized_per_sample_gradients(dtype, padding_idx, method):
    ids, g = embedding_inputs(4, 9, 6, dtype=dtype)
    assert (ids == padding_idx).any() or padding_idx < 0
    result = EMB_OP(ids, g, padding_idx, method)
    assert result.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and result.shape == (4,)
    reference = materialized_embedding_grads(ids, g, 5, padding_idx).pow(2).sum((1, 2))
    assert max_rel_err(result, reference) <= (1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("method", ["ghost", "segment"])
def test_embedding_op_all_distinct_tokens_is_the_sum_of_token_norms(method):
    ids = torch.arange(12).reshape(2, 6).flip(1)
    g = torch.randn(2, 6, 3, dtype=torch.float64)
    torch.testing.assert_close(EMB_OP(ids, g, -1, method), g.pow(2).sum((1, 2)))


def test_embedding_op_auto_picks_ghost_for_short_sequences_and_segment_for_long_ones():
    assert en.choose_embedding_norm_method(en.GHOST_MAX_TOKENS) == "ghost"
    assert en.choose_embedding_norm_method(en.GHOST_MAX_TOKENS + 1) == "segment"
    ids, g = embedding_inputs(2, en.GHOST_MAX_TOKENS + 1, 3, vocab=40)
    assert torch.equal(EMB_OP(ids, g, -1, "auto"), EMB_OP(ids, g, -1, "segment"))
    assert max_rel_err(EMB_OP(ids, g, -1, "ghost"), materialized_embedding_grads(ids, g, 40).pow(2).sum((1, 2))) < 1e-5


def test_embedding_op_refuses_bad_shapes_float_ids_and_unknown_methods():
    ids, g = embedding_inputs(2, 3, 4)
    with pytest.raises(ValueError, match="ids must be"):
        EMB_OP(ids[:, :2], g)
    with pytest.raises(ValueError, match="integer"):
        EMB_OP(ids.float(), g)
    with pytest.raises(ValueError, match="method must be one of"):
        EMB_OP(ids, g, -1, "sparse")


@pytest.mark.parametrize("method", en.METHODS)
def test_embedding_op_handles_empty_batch_and_empty_sequence(method):
    for B, T in [(0, 3), (2, 0)]:
        ids, g = torch.zeros(B, T, dtype=torch.long), torch.randn(B, T, 4)
        assert torch.equal(EMB_OP(ids, g, -1, method), torch.zeros(B))


@pytest.mark.parametrize("method", ["ghost", "segment"])
@pytest.mark.parametrize("budget", [2 * (8 * 7 * 6 + 8 * 7 + 16 * 6 * 7 + 48 * 7), 1])
def test_embedding_op_chunked_gives_the_same_result(budget, method, monkeypatch):
    ids, g = embedding_inputs(5, 7, 6, dtype=torch.float64)
    full = EMB_OP(ids, g, 1, method)
    # two samples per chunk; then one sample (and, for ghost, one row of its Gram matrix) at a time
    monkeypatch.setattr(psn, "CPU_CHUNK_BYTES", budget)
    torch.testing.assert_close(EMB_OP(ids, g, 1, method), full, rtol=1e-12, atol=0)


@pytest.mark.parametrize("method", ["ghost", "segment"])
def test_embedding_op_temporaries_stay_within_the_budget(method, monkeypatch):
    B, T, D, vocab = 16, 48, 32, 1000
    ids, g = embedding_inputs(B, T, D, vocab=vocab)
    budget = 32 * 1024                                # one sample's g (6 KiB) + its temporaries, a few samples
    assert B * T * T * 5 > 4 * budget                 # what one unchunked Gram + mask would hold
    assert B * T * D * 4 * 2 > 4 * budget             # what unchunked segment sums + masked copy would hold
    monkeypatch.setattr(psn, "CPU_CHUNK_BYTES", budget)
    with PeakBytes() as mem:
        result = en._torch_sq_norm(ids, g, 3, method)
    del result
    assert 0 < mem.peak <= budget + 2 * 4 * B, f"peak {mem.peak} bytes > budget {budget}"


@pytest.mark.parametrize("method", ["ghost", "segment"])
@pytest.mark.parametrize("padding_idx", [-1, 0])
def test_embedding_opcheck(padding_idx, method):
    ids, g = embedding_inputs(3, 5, 4)
    torch.library.opcheck(EMB_OP, (ids, g, padding_idx, method))
    torch.library.opcheck(EMB_OP, (ids, g.requires_grad_(), padding_idx, method))
    torch.library.opcheck(torch.ops.optpass.embedding_per_sample_grad_sq_norm_backward,
                          (torch.randn(3), ids, g.detach(), padding_idx, method))


@pytest.mark.parametrize("method", ["ghost", "segment"])
@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_embedding_op_gradient_matches_materialized(padding_idx, method):
    ids, g = embedding_inputs(3, 8, 4, dtype=torch.float64)
    g.requires_grad_()
    weights = torch.randn(3, dtype=torch.float64)
    ours, = torch.autograd.grad((EMB_OP(ids, g, padding_idx, method) * weights).sum(), [g])
    reference = materialized_embedding_grads(ids, g, 5, padding_idx).pow(2).sum((1, 2))
    ref, = torch.autograd.grad((reference * weights).sum(), [g])
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("padding_idx", [-1, 4])
def test_embedding_clipped_grad_equals_einsum(padding_idx):
    ids, g = embedding_inputs(4, 6, 3)
    coef = torch.rand(4)
    expected = torch.einsum("b,bvd->vd", coef, materialized_embedding_grads(ids, g, 7, padding_idx))
    torch.testing.assert_close(en.embedding_clipped_grad(ids, g, coef, 7, padding_idx), expected)
