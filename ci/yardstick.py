"""The yardstick: PyTorch's own autograd tests, run twice, plain and under `gpuautograd.enable()`.

    python ci/yardstick.py PATH/TO/test_autograd.py [--json OUT.json] [-k EXPR]

PATH is a copy of PyTorch's `test/test_autograd.py` that you fetch yourself (it is not part of
this project). It runs with pytest twice: as plain torch, and with every test wrapped in
`with gpuautograd.enable():` (ci/yardstick_plugin.py). It prints the tests that pass under plain
torch and fail under enable() (the regressions, by test id), and how many of them ran at least
one backward functionally; `--json` writes the same as JSON.

The file imports three sibling modules (`from autograd.test_complex import ...`) that live in
PyTorch's `test/autograd/` folder; the runner runs a copy without those imports, so the yardstick
is the classes of test_autograd.py itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIBLING_IMPORT = "from autograd."


@dataclass
class Outcome:
    status: str  # passed, failed, error, skipped
    message: str = ""
    marks: set = field(default_factory=set)  # "functional" / "fallback" (enable run only)


def prepared_copy(source: Path, workdir: Path) -> tuple[Path, int]:
    """A copy of `source` without the imports of its sibling modules; returns (path, lines dropped)."""
    lines = source.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if not ln.startswith(SIBLING_IMPORT)]
    target = workdir / source.name
    target.write_text("".join(kept))
    return target, len(lines) - len(kept)


def run_pytest(test_file: Path, junit: Path, enable: bool, keyword: str | None) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "ci"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
    if enable:
        env["GPUAUTOGRAD_YARDSTICK"] = "enable"
    else:
        env.pop("GPUAUTOGRAD_YARDSTICK", None)
    cmd = [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "yardstick_plugin", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    if keyword:
        cmd += ["-k", keyword]
    return subprocess.run(cmd, cwd=test_file.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode


def read_junit(junit: Path) -> dict[str, Outcome]:
    if not junit.exists():
        raise RuntimeError(f"pytest wrote no report ({junit}); it probably crashed. Rerun with -k to narrow it down.")
    results: dict[str, Outcome] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome = Outcome("passed")
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome.status = "failed" if child.tag == "failure" else child.tag
                outcome.message = (child.get("message") or "").splitlines()[0][:200] if child.get("message") else ""
            elif child.tag == "properties":
                outcome.marks = {p.get("value") for p in child if p.get("name") == "gpuautograd"}
        results[test_id] = outcome
    return results


def compare(plain: dict[str, Outcome], enabled: dict[str, Outcome], subset: bool = False) -> dict:
    """`subset`: the enable() run selected some tests (-k); compare those only."""
    if subset:
        plain = {t: o for t, o in plain.items() if t in enabled}
    passed_plain = sorted(t for t, o in plain.items() if o.status == "passed")
    regressions = [t for t in passed_plain if enabled.get(t, Outcome("missing")).status != "passed"]
    functional = [t for t in regressions if "functional" in enabled[t].marks] if regressions else []
    ran_functional = [t for t in passed_plain if "functional" in enabled.get(t, Outcome("missing")).marks]
    return {
        "tests": len(plain),
        "passed_plain": len(passed_plain),
        "regressions": len(regressions),
        "regressions_functional": len(functional),
        "passed_plain_ran_functional": len(ran_functional),
        "regression_list": [
            {
                "id": t,
                "status": enabled[t].status if t in enabled else "missing",
                "functional": t in functional,
                "message": enabled[t].message if t in enabled else "",
            }
            for t in regressions
        ],
    }


def report_text(summary: dict, dropped: int) -> str:
    lines = [
        f"tests: {summary['tests']} (sibling-module imports dropped: {dropped})",
        f"passed under plain torch: {summary['passed_plain']}",
        f"  of those, ran a backward functionally under enable(): {summary['passed_plain_ran_functional']}",
        f"regressions (pass plain, fail under enable()): {summary['regressions']}"
        f" ({summary['regressions_functional']} of them ran functionally)",
    ]
    for r in summary["regression_list"]:
        tag = "functional" if r["functional"] else "eager"
        lines.append(f"  {r['id']}  [{r['status']}, {tag}]  {r['message']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("test_file", type=Path, help="a copy of PyTorch's test/test_autograd.py")
    ap.add_argument("--json", type=Path, help="also write the summary as JSON here")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression, to run a subset")
    ap.add_argument("--plain-from", type=Path, help="reuse this junit report of an earlier plain run (same file and torch)")
    ap.add_argument("--keep", type=Path, help="copy both junit reports into this folder")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="yardstick-") as tmp:
        work = Path(tmp)
        test_file, dropped = prepared_copy(args.test_file.resolve(), work)
        plain = args.plain_from or work / "plain.xml"
        if args.plain_from is None:
            run_pytest(test_file, plain, False, args.keyword)
        run_pytest(test_file, work / "enable.xml", True, args.keyword)
        summary = compare(read_junit(plain), read_junit(work / "enable.xml"), subset=bool(args.keyword))
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for report in (plain, work / "enable.xml"):
                (args.keep / report.name).write_bytes(report.read_bytes())
    print(report_text(summary, dropped))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
