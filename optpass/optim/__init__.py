"""torch.optim's update as a graph: harvested from the optimizer (``harvest``), with its Python
scalars as tensors (``scalars``), and checked elementwise for sharding (``elementwise``)."""
