"""Two processes that build the native walker at once share one good build.

The build is a minute or two of compiling, so this is the suite's one test that runs it from an
empty cache; it runs where a C++ compiler and ninja are found, and is skipped elsewhere."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from gpuautograd import native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_TOOLCHAIN = shutil.which(os.environ.get("CXX", "c++")) is not None and importlib.util.find_spec("ninja") is not None

# Each process builds (or loads) the walker, then runs one backward with it against eager.
CHILD = """
import torch, gpuautograd
x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
gpuautograd.backward((x @ w).tanh().sum())
ours = (x.grad.clone(), w.grad.clone())
x.grad = w.grad = None
(x @ w).tanh().sum().backward()
assert gpuautograd.stats()["walker"] == "native", gpuautograd.stats()
assert all(torch.allclose(a, e) for a, e in zip(ours, (x.grad, w.grad)))
print("native walker ok")
"""


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler or ninja: the native walker can't be built here")
def test_two_processes_building_at_once_leave_one_good_build(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "GPUAUTOGRAD_NATIVE": "1", "PYTHONPATH": ROOT}
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate() for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0 and "native walker ok" in out, f"rc {p.returncode}\n{out}\n{err[-3000:]}"
    builds = sum(native.BUILDING in err for _, err in outputs)
    assert builds == 1, f"{builds} of the two processes built; the other should have waited and loaded the first's build"
    root = os.path.join(str(tmp_path), "gpuautograd", "native")
    entries = sorted(os.listdir(root))
    dirs = [e for e in entries if os.path.isdir(os.path.join(root, e))]
    assert len(dirs) == 1 and not dirs[0].startswith("."), f"the cache should hold one finished build, not {entries}"
    assert [e for e in entries if e not in dirs] == [dirs[0] + ".lock"], entries
    built = os.listdir(os.path.join(root, dirs[0]))
    assert any(name.startswith(f"gpuautograd_native_{dirs[0]}") and name.endswith(".so") for name in built), built
