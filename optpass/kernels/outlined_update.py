"""``optpass::outlined_update``: one parameter's update, compiled once per kind, called from a step graph.

A fused step graph holds one update per parameter. Lowered inline, Inductor schedules and generates
code for every one of them at every compile (a new sequence length recompiles them all, and a deeper
model adds code per layer). ``passes/outline_updates.py`` replaces each update by a call to this op;
the op runs a function Inductor compiled for that *kind* of update (the same aten graph on inputs of
the same shapes, strides, dtypes and devices), compiled the first time a kind runs in this process
and reused by every parameter of that kind, by every later compile and by every layer.

The kind's graph is stored as a pickled ``GraphModule`` under Inductor's cache directory, named by
its key, so a step graph that Inductor's FX graph cache serves in a fresh process (where the pass
did not run) finds it; Inductor's own cache then serves the kind's compiled code.

The op writes the tensors of its first list in place (the parameter, its optimizer state, a master
weight) and only reads the second (the gradient, the lr, the step count).
"""

from __future__ import annotations

import hashlib
import io
import os
import threading

import torch
import torch.fx

from optpass import cache_artifacts

_LOCK = threading.RLock()
_GRAPHS: dict[str, torch.fx.GraphModule] = {}   # key -> the kind's aten graph
_COMPILED: dict[tuple, object] = {}              # (key, input alignment) -> Inductor's callable
_LOADED_FROM_DISK = [0]                          # kinds' graphs read from disk (a cached step graph)
_ALIGNMENT = 16                                  # bytes Inductor may assume of an input's data pointer


def graph_key(gm: torch.fx.GraphModule, example_values: list[torch.Tensor]) -> str:
    """What makes two updates one kind: the graph's code and each input's layout."""
    layout = [(tuple(v.shape), tuple(v.stride()), str(v.dtype), str(v.device)) for v in example_values]
    return hashlib.sha256(repr((gm.code, layout)).encode()).hexdigest()[:32]


def register(key: str, gm: torch.fx.GraphModule) -> None:
    """Keep the kind's graph in this process and on disk beside Inductor's cache."""
    with _LOCK:
        if key in _GRAPHS:
            return
        _GRAPHS[key] = gm
    path = _graph_path(key)
    if os.path.exists(path):
        cache_artifacts.record(path)
        return
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    cache_artifacts.write_atomically(path, buffer.getvalue())
    cache_artifacts.record(path, buffer.getvalue())


def _graph_path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return os.path.join(cache_dir(), "optpass_updates", f"{key}.pt")


def _graph(key: str) -> torch.fx.GraphModule:
    with _LOCK:
        gm = _GRAPHS.get(key)
    if gm is not None:
        return gm
    path = _graph_path(key)
    if not os.path.exists(path):
        raise RuntimeError(f"optpass: the update graph {key} is neither in this process nor at {path} "
                           "(Inductor's cache directory changed under a cached step graph?); clear "
                           "Inductor's cache (torch._inductor.utils.fresh_inductor_cache) and compile again")
    with open(path, "rb") as f:
        content = f.read()
    gm = torch.load(io.BytesIO(content), weights_only=False)
    cache_artifacts.record(path, content)   # a job saving its cache artifacts takes it along
    with _LOCK:
        if key not in _GRAPHS:
            _GRAPHS[key] = gm
            _LOADED_FROM_DISK[0] += 1
        return _GRAPHS[key]


def kinds_compiled() -> int:
    """How many kinds of update Inductor compiled in this process (each once)."""
    return len(_COMPILED)


def graphs_loaded_from_disk() -> int:
    """How many kinds' graphs were read from Inductor's cache directory (a step graph Inductor's FX
    graph cache served, in a process where the pass that outlined them did not run)."""
    return _LOADED_FROM_DISK[0]


def _compiled(key: str, inputs: list[torch.Tensor]):
    aligned = tuple(t.data_ptr() % _ALIGNMENT == 0 for t in inputs)
    fn = _COMPILED.get((key, aligned))
    if fn is None:
        from torch._inductor.compile_fx import compile_fx
        with _LOCK:
            fn = _COMPILED.get((key, aligned))
            if fn is None:
                fn = compile_fx(_graph(key), _static_fakes(inputs))
                _COMPILED[(key, aligned)] = fn
    return fn


def _static_fakes(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fake copies of `inputs` with static shapes under a mode with a ShapeEnv: Inductor's FX graph
    cache bypasses a compile without one, so each kind would be compiled again in every process."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = FakeTensorMode(shape_env=ShapeEnv())
    return [mode.from_tensor(t, static_shapes=True) for t in inputs]


@torch.library.custom_op("optpass::outlined_update", mutates_args=("written",))
def outlined_update(key: str, written: list[torch.Tensor], read: list[torch.Tensor],
                    computed_before: list[torch.Tensor]) -> None:
    """Run the update of kind ``key``: writes ``written`` in place, reads ``read``.

    ``computed_before`` is not read: the values that read the old values of ``written``, passed so
    that Inductor computes them before this call (``passes/outline_updates.py``)."""
    inputs = [*written, *read]
    with torch.no_grad():
        _compiled(key, inputs)(*inputs)


@outlined_update.register_fake
def _(key, written, read, computed_before) -> None:
    return None
