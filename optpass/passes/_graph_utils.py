"""What the passes share: reading a fused gradient and splicing an update in (from
optimizer_in_backward), and the norm-only first backward with the reductions after it (from
clip_grad_norm_in_backward). A pass imports these from here, never from another pass."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.fx

from optpass.step import BACKWARD, GRADIENT_TRANSFORM, REGION_KEY, UPDATE, is_view, local_tensor_base

aten = torch.ops.aten

# Where the runtime puts the plan of a fused update in ``StepGraph.context`` (clip_grad_norm_in_backward
# clips the gradients of either).
OPTIMIZER_UPDATE = "optimizer_update"     # optimizer_in_backward's plan
MASTER_UPDATE = "master_update"           # master_weights' plan
# The Dynamo input index of the 0-d tensor into which a clipping pass writes the global gradient
# norm before clipping (clip_grad_norm_'s return value; ``runtime/grad_norm.py`` hands it out).
GRAD_NORM_OUTPUT = "grad_norm_output"


# ---------------------------------------------------------------- a fused gradient and its update

def take_gradient_outputs(step, names: list[str]) -> dict[str, torch.fx.Node]:
    """Put None in the gradient output slots of `names`; return each one's gradient value.

    Also drops what only existed to fill .grad (Dynamo's empty_like + copy, the
    accumulate-into-.grad write), so it neither keeps the gradient alive nor
    counts as a late read of the parameter."""
    graph, output = step.graph, step.output_node
    outputs = list(output.args[0])
    gradient_values = {}
    descs = output.meta.get("desc") or ()
    for name in names:
        gradient_values[name] = gradient_value(step.gradient_nodes[name])
        slot = step.gradient_slots[name]
        outputs[slot] = _no_local_tensor(step, step.gradient_nodes[name]) if _is_local_tensor(descs, slot) else None
    output.args = (tuple(outputs),) + tuple(output.args[1:])
    for name, value in gradient_values.items():
        gradient = step.gradient_nodes[name]
        if gradient is not value and not gradient.users:
            destination = gradient.args[0]
            graph.erase_node(gradient)
            if destination.op != "placeholder" and not destination.users:
                graph.erase_node(destination)    # Dynamo's empty_like(p)
    return gradient_values


def _is_local_tensor(descs, slot: int) -> bool:
    return slot < len(descs) and type(descs[slot]).__name__ == "SubclassGetAttrAOTOutput"


def _no_local_tensor(step, gradient: torch.fx.Node) -> torch.fx.Node:
    """What a fused DTensor gradient's output slot holds: AOTAutograd's runtime wraps the slot's local
    tensor into a DTensor (it cannot take None there), and the step runtime drops it (``.grad`` stays
    None); an empty tensor holds no memory."""
    value = gradient.meta["val"]
    with step.graph.inserting_before(step.output_node):
        return step.emit(aten.empty.memory_format, [0] * value.dim(), dtype=value.dtype, device=value.device)


def placeholders_by_dynamo_index(graph: torch.fx.Graph) -> dict[int, torch.fx.Node]:
    found = {}
    for node in graph.nodes:
        desc = local_tensor_base(node.meta.get("desc"))       # a DTensor input: its local tensor
        if node.op == "placeholder" and type(desc).__name__ == "PlainAOTInput":
            found[desc.idx] = node
    return found


def gradient_value(gradient: torch.fx.Node) -> torch.fx.Node:
    """The value the update reads, skipping the writes that only exist to fill `.grad`.

    `copy_(grad_input, old + new)` (accumulation into an existing .grad) -> `old + new`;
    `copy(empty_like(p), g)` (Dynamo's materialization of a new .grad, eager lowering) -> `g`,
    so the update follows the gradient's computation, not the copies after all of backward.
    """
    aten = torch.ops.aten
    if gradient.target is aten.copy_.default and gradient.args[0].op == "placeholder":
        return gradient.args[1]
    if gradient.target is aten.copy.default and getattr(gradient.args[0], "target", None) is aten.empty_like.default:
        return gradient.args[1]
    return gradient


# Ops that read only a tensor's metadata (shape, dtype): an update may run before them.
_METADATA_ONLY = {torch.ops.aten.empty_like.default, torch.ops.aten.sym_size.int,
                  torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default}


def _readers_of(param: torch.fx.Node) -> set[torch.fx.Node]:
    """Every node that reads the parameter's current value, through views too."""
    readers, stack = set(), [param]
    while stack:
        for user in stack.pop().users:
            if user in readers or user.target in _METADATA_ONLY:
                continue
            readers.add(user)
            if is_view(user):
                stack.append(user)
    return readers


# Inductor's post-grad patterns fuse an add of a matmul's result into the matmul (``addmm``, and
# ``add(mm, mm)`` into one kernel), emitted where the add stood.
_MATMULS = {aten.mm.default, aten.bmm.default}
_FUSED_INTO_A_MATMUL = {aten.add.Tensor}


def last_node_update_must_follow(position: dict, param: torch.fx.Node, gradient: torch.fx.Node) -> torch.fx.Node:
    """The node after which the in-place update of ``param`` may go: its gradient is final, every read
    of its old value (views included) is done, and so is every add of a matmul that reads it.

    The adds count because Inductor fuses one into the matmul and emits the fused op at the add's
    place: ``add(mm(g, w), r)`` becomes ``addmm(r, g, w)`` where the ``add`` stood, so an update placed
    between the ``mm`` and the ``add`` would be read by the fused matmul (a residual block's input
    gradient ``g + g @ w``: the layers below it got a gradient made with the updated weight)."""
    readers = {r for r in _readers_of(param) if r.op != "output"}
    fused_adds = {u for r in readers if r.target in _MATMULS for u in r.users if u.target in _FUSED_INTO_A_MATMUL}
    return max({gradient} | readers | fused_adds, key=position.__getitem__)


def tensor_value(node) -> torch.Tensor | None:
    """The fake tensor a node holds (``meta['val']``), or None for a non-tensor value or a constant."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def is_transpose(node) -> bool:
    """``t(x)`` or ``permute(x, [1, 0])``."""
    return isinstance(node, torch.fx.Node) and (node.target is torch.ops.aten.t.default or (
        node.target is torch.ops.aten.permute.default and list(node.args[1]) == [1, 0]))


def has_fused_loss_backward(graph: torch.fx.Graph) -> bool:
    """Whether a loss's backward is one aten op here (``_log_softmax_backward_data``: the aten graph
    of ``optpass.explain`` and ``lower="eager"``; Inductor's lowering decomposes it pointwise)."""
    return any(n.target in (aten._log_softmax_backward_data.default, aten._softmax_backward_data.default)
               for n in graph.nodes)


# Ops that make each element from the same element of their inputs without a pointwise tag.
_UNTAGGED_ELEMENTWISE = {aten.where.self, aten.clone.default, aten._to_copy.default,
                         torch.ops.prims.convert_element_type.default}


def is_elementwise(node: torch.fx.Node) -> bool:
    """A call tagged pointwise, or one of the elementwise ops that carry no tag."""
    return node.op == "call_function" and (
        torch.Tag.pointwise in getattr(node.target, "tags", ()) or node.target in _UNTAGGED_ELEMENTWISE)


def live_users(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The users of `node` that are read or have an effect (a pass that replaced a value leaves the
    old one to eliminate_dead_code)."""
    return {u for u in node.users if u.users or u.is_impure() or u.op == "output"}


def is_random_or_effectful(node: torch.fx.Node) -> bool:
    """Whether `node` draws random numbers or has a side effect (copying it would change the step)."""
    return node.is_impure() or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def copy_node(step, node: torch.fx.Node, env: dict) -> torch.fx.Node:
    """Copy one node of a harvested slice to the insert point, its inputs looked up in `env` (which
    then maps `node` to the copy), with its fake value and source line."""
    copy = step.graph.node_copy(node, lambda n: env[n])
    copy.meta = {k: v for k, v in node.meta.items() if k in ("stack_trace", "original_aten")}
    step.set_fake_value(copy)
    env[node] = copy
    return copy


def copy_slice(step, update, env, write_param: bool = True) -> list[torch.fx.Node]:
    """Copy the slice into the graph at the insert point; `env` maps its placeholders to values.

    Writes its new values into the state (and, if `write_param`, the parameter) with
    in-place copy_; `env` afterwards maps every slice node to its copy."""
    inserted = [copy_node(step, node, env) for node in update.nodes]
    for target, value in update.writes.items():
        if target is update.param and not write_param:
            continue
        inserted.append(step.write_update(env[target], env[value]))
    return inserted


# ---------------------------------------------------------------- the first backward and reductions

FIRST_BACKWARD = "first_backward"
# Inductor config that keeps the order a pass emits around collectives (docs/design.md §25):
# reorder_for_locality would move each computation next to its first user (every collective to the
# graph's end), reorder_for_peak_memory each wait right after its start.
KEEP_EMITTED_ORDER = {"reorder_for_locality": False, "reorder_for_peak_memory": False}


def keep_updates_where_gradients_die(in_backward: bool) -> dict:
    """Inductor config for a step whose updates run inside backward: keep the order the passes emit.

    Seen in Inductor's generated code (torch 2.13, CPU, a GPT with 2 blocks): with its defaults,
    ``reorder_for_locality`` (run before optpass's post-grad pass, on graphs without a backward
    graph of their own, like the step graph) moves every weight-gradient GEMM next to its only
    reader, the gradient output at the graph's end; and ``reorder_for_peak_memory`` (on Inductor's
    scheduled nodes, after fusion) again put the GEMMs together at the end, where their updates
    were fused into a few kernels. Every gradient was alive at the end of backward: 0.02 of the
    gradient bytes saved instead of about all but the largest (docs/design.md, "Where the peak is
    on language models")."""
    return dict(KEEP_EMITTED_ORDER) if in_backward else {}


@contextlib.contextmanager
def replacing_gradient(step, name: str, value: torch.fx.Node):
    """``with replacing_gradient(step, name, value) as replace: replace(new)``: `new`, computed from
    `value` inside the block, becomes what every earlier reader of `value` reads (Dynamo's copy into
    ``.grad`` included), and the gradient the fused update of `name` reads."""
    readers = set(value.users)

    def replace(new: torch.fx.Node) -> None:
        value.replace_all_uses_with(new, delete_user_cb=readers.__contains__)
        if step.gradient_nodes[name] is value:
            step.gradient_nodes[name] = new
    yield replace


@dataclasses.dataclass
class FirstBackward:
    """A copy of the backward that leads to the fused gradients, run before the real one."""

    copies: dict[torch.fx.Node, torch.fx.Node]    # original node -> its copy
    end: torch.fx.Node                            # the real backward's first node (the copy precedes it)


def first_backward(step, targets: list[torch.fx.Node]) -> FirstBackward:
    """The first backward that computes `targets` (made once per compile, shared by the passes that
    need every gradient before any update: loss scaling's inf/nan check, global-norm clipping).
    Callers reduce each copied target right after it (``reduce_after``), so it dies there."""
    made = step.context.get(FIRST_BACKWARD)
    if made is not None and all(t in made.copies for t in targets):
        return made
    graph = step.graph
    to_copy = _backward_cone(step, targets)
    end = next(n for n in graph.nodes if n in to_copy)
    # The copy reads forward values that the graph may define after `end` (see define_inputs_before).
    step.define_inputs_before(to_copy, end, "the norm-only first backward that options 'clip_grad_norm' "
                                            "and 'grad_scaler' run inside backward")
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    with graph.inserting_before(end):
        for node in list(graph.nodes):
            if node in to_copy:
                env[node] = graph.node_copy(node, lambda n: env.get(n, n))
    made = FirstBackward(env, end)
    step.context[FIRST_BACKWARD] = made
    return made


def in_graph_order(graph: torch.fx.Graph, nodes) -> list[torch.fx.Node]:
    """`nodes` in the order the graph computes them (the order their norms are summed in)."""
    wanted = set(nodes)
    return [n for n in graph.nodes if n in wanted]


def reduce_after(step, value: torch.fx.Node, reduce) -> torch.fx.Node:
    """`reduce(emit, value)` inserted right after `value`, so that `value` can die there."""
    with step.graph.inserting_before(value.next):
        return reduce(step.emit, value)


def squared_norm(emit, value: torch.fx.Node) -> torch.fx.Node:
    """sum(value * value): a 0-d tensor."""
    return emit(aten.sum.default, emit(aten.mul.Tensor, value, value))


def sum_all(emit, values: list[torch.fx.Node]) -> torch.fx.Node:
    """values[0] + values[1] + ...: adds, not stack (stack is decomposed before post-grad passes)."""
    total = values[0]
    for value in values[1:]:
        total = emit(aten.add.Tensor, total, value)
    return total


def write_grad_norm(step, norm: torch.fx.Node) -> None:
    """``copy_(out, norm)`` before the graph's output, ``out`` being the input that
    ``step.context[GRAD_NORM_OUTPUT]`` names (nothing when the runtime passed none): the step
    hands out its pre-clip global norm without a host sync."""
    index = step.context.get(GRAD_NORM_OUTPUT)
    if index is None:
        return
    out = placeholders_by_dynamo_index(step.graph)[index]
    with step.graph.inserting_before(step.output_node):
        write = step.emit(aten.copy_.default, out, norm)
    write.meta[REGION_KEY] = UPDATE


def clip_coefficient(emit, norm: torch.fx.Node, max_norm: float) -> torch.fx.Node:
    """torch.nn.utils.clip_grad_norm_'s coefficient: clamp(max_norm / (norm + 1e-6), max=1)."""
    scale = emit(aten.mul.Tensor, emit(aten.reciprocal.default, emit(aten.add.Tensor, norm, 1e-6)), max_norm)
    return emit(aten.clamp_max.default, scale, 1.0)


def _backward_cone(step, gradients: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes after the forward that a fused gradient depends on."""
    cone, stack = set(), list(gradients)
    while stack:
        node = stack.pop()
        if node in cone or step.region_of(node) not in (BACKWARD, GRADIENT_TRANSFORM):
            continue
        cone.add(node)
        stack.extend(node.all_input_nodes)
    return cone
