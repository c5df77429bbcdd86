"""Pass eliminate_dead_code: drop values that nothing reads.

Precondition: any captured graph.
Rewrite: remove pure nodes without users (FX's dead-code elimination; in-place
and other side-effecting ops are impure and stay).
Effect: fewer ops in the eager lowering and in the graphs a user reads; Inductor
would drop them too, so numerics and speed under Inductor are unchanged.
Refuses: nothing.

    before:                         after:
      t = aten.t(w)                   mm = aten.mm(x, w)
      mm = aten.mm(x, w)              return (mm,)
      return (mm,)
"""

from __future__ import annotations


def run(step, options) -> str | None:
    if not step.graph.eliminate_dead_code():
        return "no dead values"
    return None
