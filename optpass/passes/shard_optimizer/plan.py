"""What the runtime hands shard_optimizer: the plan of this rank's sharded update."""

from __future__ import annotations

import dataclasses

from optpass.passes._graph_utils import KEEP_EMITTED_ORDER


CONTEXT_KEY = "sharded_update"


@dataclasses.dataclass
class ShardPlan:
    sharded: object                            # zero1.state.ShardedOptimizer
    names: dict[int, str]                      # parameter index (optimizer order) -> name in the step
    harvested: object | None                   # HarvestedUpdate of the shard optimizer (None: owns nothing)
    lr_index: dict[int, int]                   # param group -> Dynamo input index
    state_index: dict[tuple[str, str], int]    # (shard name, state key) -> Dynamo input index
    in_backward: bool
    clip_grad_norm: float | None = None        # global-norm clipping of the averaged gradients
    collectives: str = "reduce_scatter"        # a key of PLANS (choose_collectives resolved "auto")
    master_index: dict[str, int] = dataclasses.field(default_factory=dict)  # shard name -> Dynamo input
    #                                            index of its fp32 master (master_weights)

    def digest(self) -> str:
        """What makes this rank's rewritten graph differ from another's (Inductor cache key): also the
        harvested update, since the first step (which creates SGD's momentum buffers) and the later
        ones (which read them) rewrite the same step graph differently."""
        update = self.harvested.digest() if self.harvested is not None else "no-shard"
        return (f"rank{self.sharded.rank}-{self.sharded.layout.digest()}-{self.in_backward}"
                f"-{self.collectives}-masters={sorted(self.master_index)}-{update}")

    @property
    def inductor_config(self) -> dict:
        """Inductor keeps the order this pass emits (seen in its generated code, torch 2.13, CPU):

        * ``reorder_for_locality`` (on for graphs without a backward graph of their own, like
          the step graph) runs before the post-grad passes and moves each gradient computation
          next to its user, the gradient output at the graph's end: every bucket's gradients
          would be final only after all of backward, and no collective could start during it;
        * ``reorder_for_peak_memory`` moves each bucket's wait and update right after its
          reduce starts (that frees the bucket soonest), so the step waits for every collective
          as soon as it starts."""
        return dict(KEEP_EMITTED_ORDER)
