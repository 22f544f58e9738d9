"""ci/step_runner.py on small synthetic step tables, and ci/gpu_check.sh's table and CUDA check:
statuses, timeouts that kill the step's children, a summary on disk after every step and after a
SIGTERM, packing within the file cap, exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "ci" / "step_runner.py"
GPU_CHECK = ROOT / "ci" / "gpu_check.sh"


def run_table(tmp_path: Path, table: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    cmd = [sys.executable, str(RUNNER), "--out", str(out), "--no-probe", "--grace", "1", *args, "-"]
    return subprocess.run(cmd, input=table, capture_output=True, text=True), out


def summary(out: Path) -> dict:
    data = json.loads((out / "summary.json").read_text())  # valid JSON, never half written
    assert not (out / "summary.json.tmp").exists()
    return data


def steps(out: Path) -> dict[str, dict]:
    return {s["name"]: s for s in summary(out)["steps"]}


def dead(pid: int) -> bool:
    """Gone, or a zombie waiting for its reaper (it runs nothing any more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_passing_steps_exit_0_and_record_their_files(tmp_path):
    r, out = run_table(tmp_path, 'one 60 5 - echo hello; echo "step-note: all fine"; echo {} > "$STEP_OUT/one.json"\ntwo 60 7 - true\n')
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["ok"] and s["counts"] == {"passed": 2} and s["ended"]
    one = steps(out)["one"]
    assert one["rc"] == 0 and one["files"] == ["one.json"] and one["note"] == "all fine"
    assert one["limit_s"] == 60 and one["expected_gpu_s"] == 5 and s["expected_gpu_s"] == 12
    assert "hello" in (out / "one.log").read_text() and "hello" in (out / "gpu_check.log").read_text()


def test_a_failing_and_a_timed_out_step_dont_stop_the_later_ones(tmp_path):
    table = (
        "bad 60 1 - echo broken; exit 3\n"
        'slow 1 1 - sleep 30 & echo $! > "$STEP_OUT/child.pid"; wait\n'
        'after 60 1 - echo ran > "$STEP_OUT/after.txt"\n'
    )
    r, out = run_table(tmp_path, table)
    assert r.returncode == 1
    st = steps(out)
    assert st["bad"]["status"] == "failed" and st["bad"]["rc"] == 3 and "exit status 3" in st["bad"]["reason"]
    assert st["slow"]["status"] == "timed_out" and "limit of 1 s" in st["slow"]["reason"]
    assert dead(int((out / "child.pid").read_text())), "the timed-out step's background child outlived it"
    assert st["after"]["status"] == "passed" and (out / "after.txt").read_text() == "ran\n"
    assert not summary(out)["ok"]


def test_the_summary_is_on_disk_as_soon_as_a_step_ends(tmp_path):
    # the second step copies the summary it finds: the first step's result is there, itself running
    r, out = run_table(tmp_path, 'first 60 1 - exit 4\nsecond 60 1 - cp "$STEP_OUT/summary.json" "$STEP_OUT/seen.json"\n')
    assert r.returncode == 1
    seen = {s["name"]: s for s in json.loads((out / "seen.json").read_text())["steps"]}
    assert seen["first"]["status"] == "failed" and seen["first"]["rc"] == 4
    assert seen["second"]["status"] == "running"


def test_sigterm_mid_step_leaves_a_summary_marking_that_step(tmp_path):
    out = tmp_path / "out"
    table = 'long 600 1 - sleep 300 & echo $! > "$STEP_OUT/child.pid"; wait\nnext 60 1 - true\n'
    cmd = [sys.executable, str(RUNNER), "--out", str(out), "--no-probe", "--grace", "1", "-"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    proc.stdin.write(table)
    proc.stdin.close()
    child = out / "child.pid"
    for _ in range(3000):  # a guard against hanging, not a timing check
        if child.exists() and child.read_text().strip() and steps(out)["long"]["status"] == "running":
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 128 + signal.SIGTERM
    s = summary(out)
    assert "SIGTERM" in s["stopped_by"] and s["ended"]
    assert s["steps"][0]["status"] == "interrupted" and "SIGTERM" in s["steps"][0]["reason"]
    assert s["steps"][1]["status"] == "not_run"
    assert dead(int(child.read_text()))


def test_only_and_cpu_skip_with_a_reason(tmp_path):
    r, out = run_table(tmp_path, "a 60 1 - true\nb 60 1 - exit 1\nc 60 1 cuda exit 1\n", "--only", "a,c", "--cpu")
    assert r.returncode == 0, r.stdout
    st = steps(out)
    assert st["a"]["status"] == "passed"
    assert st["b"]["status"] == "skipped" and "--only" in st["b"]["reason"]
    assert st["c"]["status"] == "skipped" and "CUDA" in st["c"]["reason"]


def test_limit_scale_multiplies_the_limits(tmp_path):
    r, out = run_table(tmp_path, 'a 10 1 - echo "$STEP_LIMIT_S" > "$STEP_OUT/limit"\n', "--limit-scale", "2.5")
    assert r.returncode == 0
    assert steps(out)["a"]["limit_s"] == 25 and (out / "limit").read_text() == "25\n"


def test_more_files_than_the_cap_are_packed_into_extras(tmp_path):
    make = 'for i in 1 2 3 4 5 6; do echo "$i" > "$STEP_OUT/r$i.json"; done; echo pic > "$STEP_OUT/chart.png"'
    r, out = run_table(tmp_path, f'make 60 1 - {make}\nlast 60 1 - echo late > "$STEP_OUT/z.json"\n')
    assert r.returncode == 0
    left = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(left) <= 8 and {"summary.json", "gpu_check.log", "extras.tar.gz"} <= set(left)
    with tarfile.open(out / "extras.tar.gz") as tar:
        packed = set(tar.getnames())
    assert {"make.log", "last.log", "chart.png"} <= packed  # logs and the chart before the results
    produced = {f"r{i}.json" for i in range(1, 7)} | {"chart.png", "z.json", "make.log", "last.log"}
    assert produced == (set(left) | packed) - {"summary.json", "gpu_check.log", "extras.tar.gz"}
    assert set(summary(out)["packed_into_extras"]) == packed


@pytest.mark.parametrize(
    "table, message",
    [("a 10 1\n", "expected NAME"), ("a x 1 - true\n", "must be numbers"), ("a 10 1 gpu true\n", "NEEDS"), ("# nothing\n", "no steps")],
)
def test_a_bad_table_is_a_usage_error(tmp_path, table, message):
    r, out = run_table(tmp_path, table)
    assert r.returncode == 2 and message in r.stderr
    assert not out.exists()


def test_list_prints_the_table_and_its_totals(tmp_path):
    r, out = run_table(tmp_path, "alpha 100 40 - true\nbeta 50 20 cuda true\n", "--list")
    assert r.returncode == 0 and not out.exists()
    lines = r.stdout.splitlines()
    assert lines[1].split()[:4] == ["alpha", "100", "40", "-"] and lines[2].split()[:4] == ["beta", "50", "20", "cuda"]
    assert lines[3].split() == ["total", "150", "60"]
    assert "worst case: 182 s" in r.stdout  # 150 + two 1 s graces + the 30 s probe


def gpu_check(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # the script's steps run `python`: the interpreter running these tests (a matrix venv's, say)
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    return subprocess.run(["bash", str(GPU_CHECK), *args], capture_output=True, text=True, cwd=tmp_path, env=env)


def test_gpu_check_table_fits_a_ten_minute_job(tmp_path):
    r = gpu_check("--list", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    names = [line.split()[0] for line in r.stdout.splitlines()[1:-2]]
    assert names == [
        "native_build", "parity", "gpu_tier", "bench_quick", "host_overhead",
        "extern_binding", "memory", "training_gpt2", "training_llama",
    ]  # fmt: skip
    worst = float(r.stdout.split("worst case: ")[1].split()[0])
    assert worst <= 540, r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_without_cuda_and_without_cpu_exits_2(tmp_path):
    r = gpu_check(str(tmp_path / "out"), tmp_path=tmp_path)
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "--cpu" in r.stderr
    s = summary(tmp_path / "out")
    assert {st["status"] for st in s["steps"]} == {"not_run"} and "CUDA" in s["stopped_by"]


def test_gpu_check_rejects_an_unknown_option(tmp_path):
    r = gpu_check("--fast", tmp_path=tmp_path)
    assert r.returncode == 2 and "unknown option --fast" in r.stderr
    assert os.listdir(tmp_path) == []


def test_gpu_check_cpu_dry_run_of_the_gpu_tier_collects_and_skips(tmp_path):
    out = tmp_path / "out"
    r = gpu_check("--cpu", "--only", "gpu_tier", str(out), tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:]
    s = summary(out)
    assert s["mode"] == "cpu dry run" and s["env"]["torch"] == torch.__version__
    st = {x["name"]: x for x in s["steps"]}
    assert st["gpu_tier"]["status"] == "passed" and "gpu_tests.xml" in st["gpu_tier"]["files"]
    assert all(x["status"] == "skipped" for name, x in st.items() if name != "gpu_tier")
