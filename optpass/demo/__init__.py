"""``python -m optpass.demo`` (``__main__``), and the small models of the demo, the tests and the
benchmarks (``models``)."""
