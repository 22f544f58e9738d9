#!/usr/bin/env bash
# The GPU checks, as the self-hosted GPU runner runs them: the GPU test tier, then the quick
# benchmark on CUDA, which writes OUT_DIR/results.json and OUT_DIR/speedup.png.
#   bash ci/gpu_check.sh [OUT_DIR]        (default: bench/out)
# Aims at under 8 minutes on one GPU. Both steps run even if the first fails; the exit status is
# non-zero if either failed. The regression gate is a separate step: ci/bench_gate.sh.
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
if [ -d tests/gpu ]; then
    echo "== GPU tier: python -m pytest -q -m gpu tests/gpu"
    rc=0
    python -m pytest -q -m gpu tests/gpu || rc=$?
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
exit "$status"
