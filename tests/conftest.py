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


@pytest.fixture(params=["native", "python"])
def walker(request, monkeypatch):
    """Run the test once with each walker (modules opt in with usefixtures("walker")). The native
    run is skipped only where the extension can't be built and GPUAUTOGRAD_NATIVE=1 isn't set (CI
    sets it, so there a failed build fails these tests); the Python run disables the extension."""
    from gpuautograd import native

    if request.param == "python":
        monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "0")
    elif os.environ.get("GPUAUTOGRAD_NATIVE") == "0":
        pytest.skip("GPUAUTOGRAD_NATIVE=0 disables the native walker")
    elif native.load() is None:
        pytest.skip(f"the native walker is unavailable: {native.reason()}")
    yield request.param
    used = gpuautograd.stats()["walker"]
    assert used == request.param or gpuautograd.stats()["python_walks"], f"ran with the {used} walker"
