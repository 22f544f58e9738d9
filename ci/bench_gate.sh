#!/usr/bin/env bash
# The benchmark regression gate: the ratios to eager of a new run against a committed baseline.
#   bash ci/bench_gate.sh NEW_RESULTS.json BASELINE.json
# Tolerance: BENCH_TOLERANCE (default 0.1, a 10% fall in a gpuautograd mode's speedup vs eager).
# Ratio compared: BENCH_METRIC (default speedup_vs_eager; cpu_speedup_vs_eager for CPU runs on a
# shared machine, where CPU-time ratios stay steady and wall-time ratios don't).
# Without a baseline file it only says so and passes: commit one from a trusted run first.
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: bash ci/bench_gate.sh NEW_RESULTS.json BASELINE.json" >&2
    exit 2
fi
new=$1 baseline=$2
case $new in /*) ;; *) new="$PWD/$new" ;; esac
case $baseline in /*) ;; *) baseline="$PWD/$baseline" ;; esac
cd "$(dirname "$0")/.."
if [ ! -f "$baseline" ]; then
    echo "notice: no baseline at $baseline yet, nothing to gate; commit one from a trusted run (a copy of its results.json)"
    exit 0
fi
python -m bench.compare "$baseline" "$new" --tolerance "${BENCH_TOLERANCE:-0.1}" --metric "${BENCH_METRIC:-speedup_vs_eager}"
