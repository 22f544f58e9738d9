"""Run a table of check steps, each under its own time limit, and keep a summary that survives a kill.

    python ci/step_runner.py --out DIR [--limit-scale F] [--only a,b] [--list] [--cpu | --require-cuda] TABLE

TABLE is a file (or `-` for stdin) with one step a line, `#` comments and blank lines ignored:

    NAME LIMIT_S EXPECTED_GPU_S NEEDS COMMAND...

NEEDS is `-` or `cuda`; COMMAND (the rest of the line) runs under `bash -c` in its own process
group, with STEP_NAME, STEP_OUT (DIR, absolute) and STEP_LIMIT_S (the scaled limit, whole seconds)
in its environment. A line the step prints starting with `step-note: ` is kept as the step's note.

Why this shape: a lent GPU machine gives one job a hard wall-clock limit and brings back only a few
files. So each step is killed (its whole process group: SIGTERM, then SIGKILL after a grace) when it
passes its limit and the next step runs; DIR/summary.json is rewritten atomically before and after
every step and on SIGTERM/SIGINT; and when DIR holds more than --max-files files, the least useful
ones (step logs first) are packed into DIR/extras.tar.gz.

Exit status: 0 every step that ran passed (skipped steps included), 1 a step failed or timed out,
2 a usage or setup error, 128+N when the runner was stopped by signal N.
Standard library only: it must run before anything is known about the machine.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field

NEEDS = ("-", "cuda")
OWN_FILES = ("summary.json", "summary.json.tmp", "gpu_check.log", "extras.tar.gz", "extras.tar.gz.tmp")
NOTE_PREFIX = b"step-note: "
PROBE_LIMIT_S = 30  # importing torch on a bare machine, cold disk
PROBE = """
import json
info = {"python": __import__("platform").python_version()}
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda_runtime"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    info["device"] = torch.cuda.get_device_name() if info["cuda_available"] else "cpu"
except Exception as e:  # reported in the summary, not raised: the steps say what broke
    info["torch_error"] = f"{type(e).__name__}: {e}"
try:
    import triton
    info["triton"] = triton.__version__
except Exception as e:
    info["triton_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(info))
"""


class UsageError(Exception):
    pass


class Stopped(Exception):
    """Raised in the main thread by the SIGTERM/SIGINT handler."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Step:
    name: str
    limit_s: float
    expected_gpu_s: float
    needs: str
    command: str
    status: str = "not_run"
    rc: int | None = None
    seconds: float | None = None
    files: list[str] = field(default_factory=list)
    reason: str = ""
    note: str = ""

    def record(self) -> dict:
        keys = ("name", "status", "rc", "seconds", "limit_s", "expected_gpu_s", "needs", "files", "reason", "note", "command")
        return {k: getattr(self, k) for k in keys}


def parse_table(text: str, source: str) -> list[Step]:
    steps = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split(None, 4)
        where = f"{source}:{lineno}: {line.strip()!r}"
        if len(parts) < 5:
            raise UsageError(f"{where}: expected NAME LIMIT_S EXPECTED_GPU_S NEEDS COMMAND...")
        name, limit, expected, needs, command = parts
        try:
            limit_s, expected_s = float(limit), float(expected)
        except ValueError:
            raise UsageError(f"{where}: LIMIT_S and EXPECTED_GPU_S must be numbers") from None
        if limit_s <= 0 or needs not in NEEDS:
            raise UsageError(f"{where}: LIMIT_S must be > 0 and NEEDS one of {NEEDS}")
        if not name.replace("_", "").replace("-", "").isalnum() or any(s.name == name for s in steps):
            raise UsageError(f"{where}: step names are unique, in letters, digits, '_' and '-'")
        steps.append(Step(name, limit_s, expected_s, needs, command))
    if not steps:
        raise UsageError(f"{source}: no steps")
    return steps


def worst_case_s(steps: list[Step], grace_s: float) -> float:
    """Every step killed at its limit, each after its grace, plus the probe."""
    return sum(s.limit_s + grace_s for s in steps) + PROBE_LIMIT_S


def print_list(steps: list[Step], grace_s: float) -> None:
    print(f"{'step':16} {'limit_s':>8} {'gpu_s':>6} {'needs':>5}  command")
    for s in steps:
        print(f"{s.name:16} {s.limit_s:8.0f} {s.expected_gpu_s:6.0f} {s.needs:>5}  {s.command}")
    limits, expected = sum(s.limit_s for s in steps), sum(s.expected_gpu_s for s in steps)
    print(f"{'total':16} {limits:8.0f} {expected:6.0f}")
    print(f"worst case: {worst_case_s(steps, grace_s):.0f} s (every limit, a {grace_s:.0f} s kill grace each, {PROBE_LIMIT_S} s probe)")


def probe_env() -> dict:
    """Versions and device, asked of a child so that this process never imports torch."""
    try:
        r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=PROBE_LIMIT_S)
    except subprocess.TimeoutExpired:
        return {"probe_error": f"importing torch took over {PROBE_LIMIT_S} s"}
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"probe_error": f"probe exited {r.returncode}: {r.stderr.strip()[-500:]}"}


def git_commit(root: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def snapshot(out: str) -> dict[str, tuple[int, int]]:
    files = {}
    for root, _, names in os.walk(out):
        for n in names:
            path = os.path.join(root, n)
            rel = os.path.relpath(path, out)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            files[rel] = (st.st_mtime_ns, st.st_size)
    return files


class Runner:
    def __init__(self, steps: list[Step], out: str, args: argparse.Namespace):
        self.steps, self.out, self.args = steps, out, args
        self.started, self.ended = now(), None
        self.env: dict = {}
        self.commit = git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.packed: list[str] = []
        self.stopped_by: str | None = None
        self.proc: subprocess.Popen | None = None
        self.log = open(os.path.join(out, "gpu_check.log"), "ab")

    # -- the summary ----------------------------------------------------------------------------
    def write_summary(self) -> None:
        counts: dict[str, int] = {}
        for s in self.steps:
            counts[s.status] = counts.get(s.status, 0) + 1
        summary = {
            "ok": self.exit_code() == 0 and self.ended is not None,
            "started": self.started,
            "ended": self.ended,
            "stopped_by": self.stopped_by,
            "commit": self.commit,
            "env": self.env,
            "mode": "cpu dry run" if self.args.cpu else "gpu",
            "limit_scale": self.args.limit_scale,
            "counts": counts,
            "seconds": round(sum(s.seconds or 0 for s in self.steps), 1),
            "limit_s": sum(s.limit_s for s in self.steps),
            "expected_gpu_s": sum(s.expected_gpu_s for s in self.steps),
            "worst_case_s": worst_case_s(self.steps, self.args.grace),
            "packed_into_extras": self.packed,
            "steps": [s.record() for s in self.steps],
        }
        path = os.path.join(self.out, "summary.json")
        with open(path + ".tmp", "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
        os.replace(path + ".tmp", path)  # a reader sees the old summary or the new one, never half

    def exit_code(self) -> int:
        return 1 if any(s.status in ("failed", "timed_out") for s in self.steps) else 0

    def say(self, text: str) -> None:
        line = f"== [{now()}] {text}\n".encode()
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
        self.log.write(line)
        self.log.flush()

    # -- one step -------------------------------------------------------------------------------
    def skip_reason(self, s: Step) -> str | None:
        if self.args.only and s.name not in self.args.only:
            return "not selected by --only"
        if s.needs == "cuda" and self.args.cpu:
            return "needs CUDA; --cpu dry run"
        return None

    def run_step(self, s: Step) -> None:
        before = snapshot(self.out)
        s.status, s.reason = "running", f"started {now()}"
        self.write_summary()  # a kill -9 of the runner still leaves the running step marked
        self.say(f"{s.name}: limit {s.limit_s:.0f} s: {s.command}")
        env = dict(os.environ, STEP_NAME=s.name, STEP_OUT=self.out, STEP_LIMIT_S=str(int(s.limit_s)))
        step_log = open(os.path.join(self.out, f"{s.name}.log"), "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            ["bash", "-c", s.command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )  # fmt: skip
        notes: list[bytes] = []
        reader = threading.Thread(target=self.tee, args=(self.proc.stdout, step_log, notes), daemon=True)
        reader.start()
        try:
            s.rc = self.proc.wait(timeout=s.limit_s)
            s.status = "passed" if s.rc == 0 else "failed"
            s.reason = "" if s.rc == 0 else f"exit status {s.rc}"
        except subprocess.TimeoutExpired:
            self.kill_group(self.args.grace)
            s.rc, s.status = self.proc.returncode, "timed_out"
            s.reason = f"passed its limit of {s.limit_s:.0f} s; process group killed"
        except Stopped as e:  # the job is going away: stop the step as a timeout would, keep its record
            self.kill_group(min(self.args.grace, 2))
            s.rc, s.status = self.proc.returncode, "interrupted"
            s.reason = f"the runner got {e} during this step; process group killed"
            raise
        finally:
            s.seconds = round(time.monotonic() - t0, 1)
            self.kill_group(0)  # what the step left running in the background goes with it
            reader.join(timeout=5)  # a grandchild that left the group may hold the pipe: don't wait on it
            step_log.close()
            s.note = b"; ".join(notes).decode(errors="replace")
            s.files = sorted(f for f, st in snapshot(self.out).items() if before.get(f) != st and not self.own(f))
            self.proc = None
        self.say(f"{s.name}: {s.status} after {s.seconds} s{': ' + s.reason if s.reason else ''}")

    def tee(self, pipe, step_log, notes: list[bytes]) -> None:
        pending = b""
        for chunk in iter(lambda: os.read(pipe.fileno(), 65536), b""):
            try:
                for f in (step_log, self.log, sys.stdout.buffer):
                    f.write(chunk)
                    f.flush()
            except ValueError:  # the step was given up on and its log closed; what comes now is lost
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            notes.extend(line[len(NOTE_PREFIX) :].strip() for line in lines if line.startswith(NOTE_PREFIX))

    def kill_group(self, grace_s: float) -> None:
        """SIGTERM the step's process group, SIGKILL what is left after the grace (at once with 0)."""
        proc = self.proc
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
            if grace_s == 0 and sig == signal.SIGTERM:
                continue
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM and not self.group_alive(proc.pid):
                return

    @staticmethod
    def group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def own(self, rel: str) -> bool:
        return rel in OWN_FILES or rel in {f"{s.name}.log" for s in self.steps}

    # -- few files back -------------------------------------------------------------------------
    def pack(self) -> None:
        """Keep DIR within --max-files: pack step logs first, then the files last in line, into extras.tar.gz."""
        files = snapshot(self.out)
        files.pop("summary.json.tmp", None)
        if len(files) <= self.args.max_files:
            return
        # the open combined log is never packed; then the steps' JSON results, in step order
        keep_first = ["summary.json", "gpu_check.log"] + [f for s in self.steps for f in s.files if f.endswith(".json")]
        rank = {f: i for i, f in enumerate(keep_first)}
        passed_logs = {f"{s.name}.log" for s in self.steps if s.status == "passed"}  # a failed step's log says more
        order = sorted(
            (f for f in files if f != "extras.tar.gz"), key=lambda f: (rank.get(f, len(rank)), f.endswith(".log"), f in passed_logs, f)
        )
        keep = order[: self.args.max_files - 1]  # one place left for extras.tar.gz itself
        to_pack = [f for f in order if f not in keep]
        self.write_extras(to_pack)
        for f in to_pack:
            os.remove(os.path.join(self.out, f))
        self.packed = sorted(set(self.packed) | set(to_pack))

    def write_extras(self, names: list[str]) -> None:
        path = os.path.join(self.out, "extras.tar.gz")
        old: dict[str, bytes] = {}
        if os.path.exists(path):  # gzip can't be appended to: carry the earlier members over
            with tarfile.open(path) as tar:
                old = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        with tarfile.open(path + ".tmp", "w:gz") as tar:
            for name, data in old.items():
                if name not in names:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
            for name in names:
                tar.add(os.path.join(self.out, name), arcname=name)
        os.replace(path + ".tmp", path)

    # -- the whole run --------------------------------------------------------------------------
    def run(self) -> int:
        for s in self.steps:
            if reason := self.skip_reason(s):
                s.status, s.reason = "skipped", reason
        try:
            if self.args.probe:
                self.say(f"probing torch, triton and the device (at most {PROBE_LIMIT_S} s)")
                self.env = probe_env()
                self.say(f"env: {json.dumps(self.env)}")
            if self.args.require_cuda and not self.env.get("cuda_available"):
                self.stopped_by = "setup: torch sees no CUDA device"
                self.finish()
                raise UsageError(f"torch sees no CUDA device ({self.env}); for a dry run without a GPU pass --cpu")
            for s in self.steps:
                if s.status == "not_run":
                    self.run_step(s)
                    self.write_summary()  # each step's result is on disk as soon as it ends
                    self.pack()
            self.finish()
        except Stopped as e:
            self.stopped_by = f"signal {e}"
            if self.proc is not None:  # the signal came between the step's start and its wait
                self.kill_group(min(self.args.grace, 2))
                for s in self.steps:
                    if s.status == "running":
                        s.status, s.reason = "interrupted", f"the runner got {e} as this step started or ended"
            self.say(f"stopped by {e}")
            self.finish()
            return 128 + e.signum
        return self.exit_code()

    def finish(self) -> None:
        self.ended = now()
        self.write_summary()
        self.pack()
        self.write_summary()  # again: it names what pack() moved
        self.log.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ci/step_runner.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", help="step table file, or - for stdin")
    p.add_argument("--out", help="output folder (created); required unless --list")
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiply every limit (a slower machine's dry run)")
    p.add_argument("--only", type=lambda t: [n for n in t.split(",") if n], help="comma-separated steps to run; the rest are skipped")
    p.add_argument("--list", action="store_true", help="print the table, its totals and worst case, and exit")
    p.add_argument("--cpu", action="store_true", help="dry run without a GPU: steps needing CUDA are skipped")
    p.add_argument("--require-cuda", action="store_true", help="exit 2 before any step when torch sees no CUDA device")
    p.add_argument("--no-probe", dest="probe", action="store_false", help="don't ask torch for versions and device (tests)")
    p.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL of a timed-out step (default 3)")
    p.add_argument("--max-files", type=int, default=8, help="files OUT may hold before logs are packed (default 8)")
    args = p.parse_args(argv)
    if args.limit_scale <= 0 or args.max_files < 3:
        p.error("--limit-scale must be > 0 and --max-files at least 3")
    if not args.list and not args.out:
        p.error("--out is required")
    return args


def load_steps(args: argparse.Namespace) -> list[Step]:
    if args.table == "-":
        text, source = sys.stdin.read(), "<stdin>"
    else:
        try:
            with open(args.table) as f:
                text, source = f.read(), args.table
        except OSError as e:
            raise UsageError(f"cannot read the step table: {e}") from None
    steps = parse_table(text, source)
    unknown = set(args.only or ()) - {s.name for s in steps}
    if unknown:
        raise UsageError(f"--only names no step: {', '.join(sorted(unknown))} (steps: {', '.join(s.name for s in steps)})")
    for s in steps:
        s.limit_s = round(s.limit_s * args.limit_scale, 1)
    return steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        steps = load_steps(args)
        if args.list:
            print_list(steps, args.grace)
            return 0
        out = os.path.abspath(args.out)
        os.makedirs(out, exist_ok=True)
        runner = Runner(steps, out, args)

        def stop(signum, frame):
            for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the summary short
                signal.signal(sig, signal.SIG_IGN)
            raise Stopped(signum)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        return runner.run()
    except UsageError as e:
        print(f"ci/step_runner.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
