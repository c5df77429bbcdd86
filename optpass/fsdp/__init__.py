"""Fully sharded data parallel (ZeRO-3): parameters, gradients and optimizer state sharded over ranks.

``optpass.fully_shard(model)`` (``shard.py``) makes each registered parameter this rank's shard and
gathers it where the module reads it (``gather.py``: an all-gather whose gradient is the
reduce-scatter onto the shard); a step compiled with ``data_parallel="fsdp"`` gathers each
parameter again in backward instead of keeping it (the pass ``reshard_after_forward``) and, with
``optimizer_in_backward``, updates each shard as soon as its reduce-scatter is done.
``checkpoint.py``: ``full_state_dict``, and DCP checkpoints that load on any number of ranks.
"""

from optpass.fsdp.checkpoint import (full_state_dict, fsdp_state_dict, load_full_state_dict, load_sharded_checkpoint,
                                     save_sharded_checkpoint)
from optpass.fsdp.shard import ShardSpec, fully_shard, optimizer_group, replaced_name, shard_spec, sharded_parameters

__all__ = ["fully_shard", "full_state_dict", "load_full_state_dict", "fsdp_state_dict", "save_sharded_checkpoint",
           "load_sharded_checkpoint", "ShardSpec", "shard_spec", "sharded_parameters", "replaced_name",
           "optimizer_group"]
