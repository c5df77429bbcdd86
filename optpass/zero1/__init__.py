"""ZeRO-1: the optimizer state sharded over the ranks of a data-parallel step.

``state`` holds this rank's shard (``sharded_state(opt)``), ``adopt`` takes the state an
optimizer already holds when it is sharded, ``checkpoint`` saves and loads the shards with
torch.distributed.checkpoint, ``agreement`` makes the ranks agree before their first collective.
"""

from optpass.zero1.state import ShardedOptimizer, sharded_state

__all__ = ["ShardedOptimizer", "sharded_state"]
