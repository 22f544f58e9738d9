#!/usr/bin/env bash
# The GPU checks, as the self-hosted GPU runner runs them: the GPU test tier (a JUnit report in
# OUT_DIR/gpu_tests.xml), the quick benchmark on CUDA (eager, compiled autograd, triton and
# cudagraph on the model suite: OUT_DIR/results.json and OUT_DIR/speedup.png), the host time per
# node on the replay path (OUT_DIR/host_overhead.json) and the extern-input binding comparison
# (OUT_DIR/extern_binding.json).
#   bash ci/gpu_check.sh [OUT_DIR]        (default: bench/out)
# Aims at under 8 minutes on one GPU. Every step runs even if an earlier one fails; the exit
# status is non-zero if any failed. The regression gate is a separate step: ci/bench_gate.sh.
set -euo pipefail
out=${1:-bench/out}
case $out in /*) ;; *) out="$PWD/$out" ;; esac
cd "$(dirname "$0")/.."
export TRITON_DEFAULT_FP_FUSION=0

python - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("ci/gpu_check.sh: torch sees no CUDA device")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PY

status=0
# The native walker, built against this machine's torch (about a minute, cached), then the parity
# tests: both walkers must hit alike and hand the program the same tensors. A torch the walker
# doesn't compile against fails this step; gpuautograd itself then runs the Python walk.
echo "== native walker: build, then the parity tests"
GPUAUTOGRAD_NATIVE=1 python -c "from gpuautograd import native; native.load()" || status=$?
GPUAUTOGRAD_NATIVE=1 python -m pytest -q tests/unit/test_native_walker.py tests/unit/test_checkpoint_opaque.py || status=$?

if [ -d tests/gpu ]; then
    echo "== GPU tier: python -m pytest -q -m gpu tests/gpu"
    rc=0
    mkdir -p "$out"
    python -m pytest -q -m gpu tests/gpu --junitxml="$out/gpu_tests.xml" || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "notice: tests/gpu holds no test marked gpu"
    elif [ "$rc" -ne 0 ]; then
        status=$rc
    fi
else
    echo "== GPU tier: notice: tests/gpu does not exist, skipped"
fi

echo "== quick benchmark on CUDA -> $out"
python -m bench --quick --device cuda --out "$out" || status=$?

echo "== host time per node on the replay path -> $out/host_overhead.json"
python -m bench.host_overhead --device cuda --iters 40 --out "$out" || status=$?

echo "== extern inputs: static buffers against table-reading kernels -> $out/extern_binding.json"
python -m bench.extern_binding --rounds 10 --out "$out" || status=$?
exit "$status"
