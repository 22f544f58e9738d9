import os

import pytest
import torch

import gpuautograd

# Kernels and CPU reference must agree bit for bit where they can: no FMA contraction.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
# Fallbacks and degradations are only logged by default; the suite also turns them into warnings,
# so that a test marked filterwarnings("error:gpuautograd falls back") fails when one happens.
# (tests/unit/test_reports.py checks the default, where no warning is raised.)
os.environ.setdefault("GPUAUTOGRAD_WARN_FALLBACKS", "1")


@pytest.fixture(autouse=True)
def isolated_gpuautograd():
    """Every test starts with an empty plan cache, zeroed counters and a fixed random state, so
    no test depends on another's captures, recapture budget or random draws."""
    gpuautograd.reset()
    torch.manual_seed(0)
    yield
