"""Tools that read graphs: normalized graph text and diffs (``diff``), and peak-memory estimates
and measurements (``memory``). They load on first use (``optpass.graph_diff``, ...)."""
