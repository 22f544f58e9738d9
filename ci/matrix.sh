#!/usr/bin/env bash
# The version matrix: for each supported pair of torch and triton, on the CPU,
#   1. the native walker built against that torch (a failed build fails the pair),
#   2. the whole suite (its end-to-end tests run once per walker, native and Python),
#   3. compile_check of every model of bench/models.py, for sm_80 and sm_90, with that triton
#      (both the "cudagraph" and the "triton" plans' kernels).
#
#   bash ci/matrix.sh [TORCH:TRITON ...]    (default: every pair in SUPPORTED)
#   bash ci/matrix.sh 2.11.0:3.6.0 -- tests/unit/test_fidelity_last.py   (a narrower pytest run)
#
# Each pair runs in a virtual environment made once and reused, under $GPUAUTOGRAD_MATRIX_HOME
# (default: the user's cache folder, gpuautograd/matrix). torch 2.11 from pip is a CUDA build of
# several GB (it runs on the CPU), so the matrix stays out of .ci/run, which tests the newest pair
# only. The checkout itself is imported (PYTHONPATH), not installed, so one environment serves any
# checkout. Writes $GPUAUTOGRAD_MATRIX_OUT (default bench/out/matrix.json): per pair, the suite's
# counts and the compile_check failures. Exits non-zero when any pair failed anything.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

# The pairs the README and pyproject.toml declare: the GPU machine's, and CI's.
SUPPORTED=("2.11.0:3.6.0" "2.13.0:3.9.0")
MODELS=(mlp cnn gpt gpt-manual-attn llama moe lstm-lm gnn stft-loss fno)

home=${GPUAUTOGRAD_MATRIX_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuautograd/matrix}
out=${GPUAUTOGRAD_MATRIX_OUT:-bench/out/matrix.json}
mkdir -p "$home" "$(dirname "$out")"

pairs=()
pytest_args=(tests)
while [ $# -gt 0 ]; do
    case $1 in
        --) shift; pytest_args=("$@"); break ;;
        *:*) pairs+=("$1") ;;
        *) echo "ci/matrix.sh: expected TORCH:TRITON (as 2.11.0:3.6.0), got '$1'" >&2; exit 2 ;;
    esac
    shift
done
[ ${#pairs[@]} -gt 0 ] || pairs=("${SUPPORTED[@]}")

environment() {  # environment TORCH TRITON: echo the pair's python, making its venv first if needed
    local torch=$1 triton=$2 dir="$home/torch$1-triton$2"
    if ! "$dir/bin/python" -c "import torch, triton, pytest, ninja, numpy, expecttest" >/dev/null 2>&1; then
        echo "== making $dir (once; torch $torch from pip can be several GB)" >&2
        python3 -m venv "$dir" >&2 || return 1
        "$dir/bin/python" -m pip install --quiet "torch==$torch" "triton==$triton" \
            numpy ninja "pytest>=7" expecttest >&2 || return 1
    fi
    echo "$dir/bin/python"
}

results=()
status=0
for pair in "${pairs[@]}"; do
    torch=${pair%%:*} triton=${pair#*:}
    echo "== torch $torch + triton $triton"
    py=$(environment "$torch" "$triton") || { echo "could not make the environment for $pair"; status=1; continue; }
    export PYTHONPATH=$repo TRITON_DEFAULT_FP_FUSION=0 GPUAUTOGRAD_NATIVE=1
    versions=$("$py" -c "import torch, triton; print(torch.__version__, triton.__version__)")
    echo "   $versions"

    build=0
    "$py" -c "from gpuautograd import native; native.load()" || build=$?

    junit=$(mktemp)
    suite=0
    "$py" -m pytest -q -p no:cacheprovider --junitxml="$junit" "${pytest_args[@]}" || suite=$?

    archs=0
    for backend in cudagraph triton; do
        args=()
        for m in "${MODELS[@]}"; do args+=(--model "$m"); done
        echo "== compile_check, $backend plans, sm_80 and sm_90"
        "$py" -m gpuautograd compile-check "${args[@]}" --arch 80 --arch 90 --backend "$backend" 2>&1 |
            grep -v "^W[0-9]" | tee -a "$junit.cc" || archs=1  # torch's "no CUDA runtime" log lines aside
    done

    line=$("$py" - "$pair" "$versions" "$build" "$suite" "$archs" "$junit" <<'PY'
import json, re, sys
import xml.etree.ElementTree as ET

pair, versions, build, suite, archs, junit = sys.argv[1:]
compiled = failed = 0
try:
    for m in re.finditer(r"(\d+) compiled, (\d+) failed", open(junit + ".cc").read()):
        compiled, failed = compiled + int(m[1]), failed + int(m[2])
except OSError:
    pass
counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
try:
    for s in ET.parse(junit).getroot().iter("testsuite"):
        for k in counts:
            counts[k] += int(s.get(k, 0))
except (OSError, ET.ParseError):
    counts = None
print(json.dumps({
    "pair": pair, "versions": versions, "native_build_rc": int(build), "pytest_rc": int(suite),
    "suite": counts, "compile_check_failed": bool(int(archs)),
    "compile_check": {"compiled": compiled, "failed": failed},
}))
PY
)
    rm -f "$junit" "$junit.cc"
    echo "   $line"
    results+=("$line")
    if [ "$build" -ne 0 ] || [ "$suite" -ne 0 ] || [ "$archs" -ne 0 ]; then
        status=1
    fi
done

(IFS=,; echo "[${results[*]}]") >"$out"
echo "== matrix: $out (exit $status)"
exit "$status"
