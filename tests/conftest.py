import os

import pytest
import torch

import gpuautograd

# Kernels and CPU reference must agree bit for bit where they can: no FMA contraction.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")


@pytest.fixture(autouse=True)
def isolated_gpuautograd():
    """Every test starts with an empty plan cache, zeroed counters and a fixed random state, so
    no test depends on another's captures, recapture budget or random draws."""
    gpuautograd.reset()
    torch.manual_seed(0)
    yield
