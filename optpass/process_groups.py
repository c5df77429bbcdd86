"""The process group optpass's fully sharded collectives run on: on gloo, a twin with one worker thread.

Why (docs/design.md §45): torch 2.13's gloo runs each process group's collectives on two worker
threads, and two functional collectives handled by those two threads at once can corrupt the
process's heap (a block freed twice, once by each thread). Two all-gathers in flight crash a rank
within seconds, run after run; the same on a group whose gloo backend has one worker thread ran
20,000 rounds in every run (``python3 bench/gloo_collectives_in_flight.py``). So every collective a
``fully_shard`` parameter needs (its all-gathers and reduce-scatters in the step's graph and in an
evaluation outside it, the clipped norm's and the found-inf flags' all-reduces) goes, on gloo,
through a twin of the user's group: the same ranks, connections of its own, one worker thread. Its
collectives run one after another in the order they were started, while the step computes; the
user's own collectives on the user's group are untouched. On NCCL (and every other backend) the
user's group is used as it is.

The twin is made once per group, the first time a rank asks for it (``fully_shard``: every rank of
the group, at the same point of the program), and registered under its own name
(``<group name>/optpass-one-thread``), the name the step graph's functional collectives carry.
"""

from __future__ import annotations

import atexit
import weakref

import torch
import torch.distributed as dist

from optpass.errors import OptpassError

TWIN_SUFFIX = "/optpass-one-thread"
_TWINS: dict[str, tuple[object, object, str]] = {}    # user's group name -> (weakref to it, twin, twin's name)
_MADE: dict[str, int] = {}                              # user's group name -> twins made for it in this process


def backend_for_device(backends: str, device_type: str) -> str:
    """The backend of ``dist.get_backend(group)`` ("gloo", or "cpu:gloo,cuda:nccl" for a group with
    one per device type) that runs collectives on tensors of `device_type`."""
    if ":" not in backends:
        return backends
    per_device = dict(item.split(":", 1) for item in backends.split(","))
    if device_type not in per_device:
        raise OptpassError(f"the process group has no backend for {device_type} tensors (its backends: "
                           f"{backends}); create it with one for the parameters' device.")
    return per_device[device_type]


def collective_group_name(group, device_type: str) -> str:
    """The name of the process group that runs optpass's collectives of `group`'s ranks on tensors of
    `device_type`: `group`'s own, or on gloo its twin with one worker thread (made on first use:
    every rank of `group` must ask, as for any collective)."""
    if backend_for_device(dist.get_backend(group), device_type) != "gloo":
        return group.group_name
    known = _TWINS.get(group.group_name)
    if known is not None and known[0]() is group and _registered(known[2]) is known[1]:
        return known[2]
    if known is not None:           # its group was destroyed (destroy_process_group), a new one has its name
        _shut_down(known[1])
    twin, name = _one_thread_twin(group)
    _TWINS[group.group_name] = (weakref.ref(group), twin, name)
    return name


def gloo_worker_threads(group_name: str) -> int | None:
    """How many worker threads the gloo backend of the registered group `group_name` runs (None: the
    group has no gloo backend)."""
    group = _registered(group_name)
    try:
        backend = _gloo_backend(group) if group is not None else None
    except RuntimeError:
        return None
    return backend.options._threads if backend is not None else None


def _gloo_backend(group):
    """`group`'s backend for CPU tensors as the ProcessGroupGloo it is (TORCH_DISTRIBUTED_DEBUG=DETAIL
    wraps it), or None when it is not gloo."""
    backend = group._get_backend(torch.device("cpu"))
    while not isinstance(backend, dist.ProcessGroupGloo) and hasattr(backend, "wrapped_pg"):
        backend = backend.wrapped_pg
    return backend if isinstance(backend, dist.ProcessGroupGloo) else None


def _one_thread_twin(group) -> tuple[object, str]:
    from torch._C._distributed_c10d import ProcessGroup, _register_process_group
    from torch.distributed.distributed_c10d import _world

    user_backend = _gloo_backend(group)
    made = _MADE.get(group.group_name, 0)
    _MADE[group.group_name] = made + 1
    name = group.group_name + TWIN_SUFFIX + (f".{made}" if made else "")
    options = dist.ProcessGroupGloo._Options()
    options._threads = 1
    options._devices = user_backend.options._devices      # the interfaces the user's group connects over
    options._timeout = user_backend.options._timeout
    store = dist.PrefixStore(f"optpass/{name}/", _client_of(_world.pg_map[group][1]))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    backend = dist.ProcessGroupGloo(store, rank, world, options)
    twin = ProcessGroup(store, rank, world)
    twin._set_default_backend(ProcessGroup.BackendType.GLOO)
    twin._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    twin._set_group_name(name)
    _register_process_group(name, twin)
    return twin, name


def _client_of(store):
    """A store for the twin's rendezvous that does not keep the user's TCPStore server alive: a new
    client of it. A twin holding the user's store would keep the server's port bound after
    destroy_process_group, and a new init_process_group on that port could hang. Any other store
    as it is."""
    root = store
    while hasattr(root, "underlying_store"):
        root = root.underlying_store
    if not isinstance(root, dist.TCPStore):
        return store
    return dist.TCPStore(root.host, root.port, is_master=False, timeout=root.timeout, wait_for_workers=False)


def _shut_down(twin) -> None:
    """Stop a twin's worker thread and close its connections, as destroy_process_group does for the
    groups it knows (a gloo backend left to the interpreter's exit can abort the process)."""
    try:
        twin.shutdown()
    except RuntimeError:
        pass


@atexit.register
def _shut_down_every_twin() -> None:
    for _, twin, _ in _TWINS.values():
        _shut_down(twin)
    _TWINS.clear()


def _registered(name: str):
    from torch._C._distributed_c10d import _resolve_process_group
    try:
        return _resolve_process_group(name)
    except (RuntimeError, ValueError):
        return None
