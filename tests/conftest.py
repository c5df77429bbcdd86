import os
import sys

import pytest
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo caches per code object: every test starts from a clean cache (docs/design.md, Measuring)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def float64_default():
    """Optimizer step counters follow the default dtype; float64 keeps rounding out of parity tests."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
