#!/usr/bin/env bash
# The GPU checks, sized for one short job on a lent GPU machine (10 minutes at most, the native
# walker, every Triton kernel and compiled autograd's baseline all built cold) and run the same by
# the self-hosted GPU runner:
#   bash ci/gpu_check.sh [--cpu] [--limit-scale F] [--only a,b] [--list] [OUT_DIR]   (default: bench/out)
# Correctness first (native walker build, parity tests, the tests/gpu tier), then the benchmarks.
# ci/step_runner.py runs the table below: each step under its own limit (its process group killed
# when it passes it, the next step runs), its log in OUT_DIR/<step>.log and OUT_DIR/gpu_check.log,
# OUT_DIR/summary.json rewritten atomically before and after each step and on SIGTERM/SIGINT
# (status, rc, seconds, limit, expected GPU time and files of each step; versions, device, commit).
# OUT_DIR keeps at most 8 files: the step logs, then the results last in line, go into extras.tar.gz.
# Exit status: 0 all passed, 1 a step failed or timed out, 2 usage error or no CUDA device (without
# --cpu), 128+N stopped by signal N.
#   --cpu            dry run without a GPU: each step runs its CPU equivalent (--device cpu; the
#                    tests/gpu tier collects and skips; extern_binding checks in the interpreter);
#                    steps marked `cuda` are skipped (none today). Use --limit-scale 4 on 2 cores.
#   --limit-scale F  multiply every limit (and with it each training step's --budget)
#   --only a,b       run these steps, skip the rest      --list  print the table and worst case
#
# Expected time on one H200 (torch 2.11, triton 3.6, a 16-core host; nothing measured there yet),
# estimated from what each step does there and from the --cpu dry run on 2 shared cores (in
# brackets: cold native cache, a loaded machine, the dry run's CPU equivalent of the step):
#   step           limit expected  [dry run]
#   native_build    100   60 s  [70-94 s] one ~1600-line C++ file against torch's headers: a single
#                                       compiler job, so 16 cores don't help; parity would build
#                                       it again if this step timed out
#   parity           35   15 s  [19-25 s] CPU-bound walker tests; importing torch is a good part
#   gpu_tier         75   55 s   [4-5 s] 93 tests (the suite's 10 models per backend, cuDNN's RNN
#                                       and CTC, ...), compiling Triton kernels cold (about 1 s a
#                                       kernel); the dry run only collects and skips them
#   bench_quick      90   70 s [31-64 s] compiled autograd's cold Dynamo+Inductor compile dominates,
#                                       then gpuautograd's kernels for each model, compiled cold
#   host_overhead    20   15 s [10-21 s] 40 replays a model; kernels found in Triton's disk cache
#   extern_binding   35   25 s  [5-7 s] --quick: d=768, B*T=2048, 3 products x 2 dtypes, 10
#                                       replays; the dry run checks in the interpreter instead;
#                                       then bench.matmul_epilogue --quick: a fused GELU epilogue
#                                       against cuBLAS + a kernel, 2 dtypes x 5 rounds [plans only]
#   memory           20   10 s   [see RESULTS] eager, triton and cudagraph backward once a model
#   training_gpt2    50   40 s   [see RESULTS] --budget 35: eager, then gpuautograd's modes
#                                       (kernels compiled cold), then compiled autograd as the
#                                       budget allows; what doesn't fit is a `skipped` row
#   training_llama   55   40 s   [see RESULTS] --budget 40: eager and gpuautograd's modes at best
#   total           480  330 s
# Worst case: 480 s of limits + 9 x 3 s kill grace + a 30 s torch probe = 537 s, within 540 s: a
# 10-minute job keeps a minute for the machine's start and the files' transfer.
# The training sizes compile minutes of kernels cold in every mode, so one shared job measures
# eager and gpuautograd there at best. All five modes take a second job of their own:
#   bash ci/gpu_check.sh --only training_gpt2,training_llama --limit-scale 4 OUT_DIR
# (limits 200 s and 220 s, budgets scaled alike: 456 s worst case).
# The regression gate is a separate step: ci/bench_gate.sh.
set -euo pipefail
usage="usage: bash ci/gpu_check.sh [--cpu] [--limit-scale F] [--only a,b] [--list] [OUT_DIR]"
out=bench/out device=cuda runner_args=()
while [ $# -gt 0 ]; do
    case $1 in
        --cpu) device=cpu runner_args+=(--cpu) ;;
        --list) runner_args+=(--list) ;;
        --limit-scale | --only)
            [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
            runner_args+=("$1" "$2")
            shift
            ;;
        -h | --help) echo "$usage"; exit 0 ;;
        -*) echo "ci/gpu_check.sh: unknown option $1" >&2; echo "$usage" >&2; exit 2 ;;
        *) out=$1 ;;
    esac
    shift
done
case $out in /*) ;; *) out="$PWD/$out" ;; esac
cd "$(dirname "$0")/.."
[ "$device" = cuda ] && runner_args+=(--require-cuda)
export TRITON_DEFAULT_FP_FUSION=0  # kernels and the reference agree bit for bit only without FMA contraction
export GPU_CHECK_DEVICE=$device

# NAME LIMIT_S EXPECTED_GPU_S NEEDS COMMAND (bash; STEP_OUT, STEP_LIMIT_S and GPU_CHECK_DEVICE set)
# native_build: a torch the walker doesn't compile against fails here; gpuautograd then walks in Python.
# gpu_tier: pytest's exit 5 (nothing collected) passes with a note.
# training_*: --budget is the whole command's budget, 15 s under the limit, so it ends itself cleanly.
exec python ci/step_runner.py --out "$out" "${runner_args[@]}" - <<'TABLE'
native_build    100  60 - GPUAUTOGRAD_NATIVE=1 python -c "from gpuautograd import native; native.load(); print('native walker built')"
parity           35  15 - GPUAUTOGRAD_NATIVE=1 python -m pytest -q -p no:cacheprovider tests/unit/test_native_walker.py tests/unit/test_checkpoint_opaque.py
gpu_tier         75  55 - python -m pytest -q -p no:cacheprovider -m gpu tests/gpu --junitxml="$STEP_OUT/gpu_tests.xml"; rc=$?; if [ $rc -eq 5 ]; then echo "step-note: no test marked gpu was collected (pytest exit 5)"; rc=0; fi; exit $rc
bench_quick      90  70 - python -m bench --quick --device "$GPU_CHECK_DEVICE" --out "$STEP_OUT"
host_overhead    20  15 - python -m bench.host_overhead --device "$GPU_CHECK_DEVICE" --iters 40 --out "$STEP_OUT"
extern_binding   35  25 - python -m bench.extern_binding --quick --rounds 10 --out "$STEP_OUT" && python -m bench.matmul_epilogue --quick --rounds 5 --out "$STEP_OUT"
memory           20  10 - python -m bench.memory --device "$GPU_CHECK_DEVICE" --out "$STEP_OUT"
training_gpt2    50  40 - python -m bench --size gpt2-small --device "$GPU_CHECK_DEVICE" --out "$STEP_OUT" --budget $((STEP_LIMIT_S - 15))
training_llama   55  40 - python -m bench --size llama-1b --device "$GPU_CHECK_DEVICE" --out "$STEP_OUT" --budget $((STEP_LIMIT_S - 15))
TABLE
