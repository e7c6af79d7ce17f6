"""What the sandbox's seccomp filter costs per program: programs per second, with and without.

    .venv/bin/python bench/bench_sandbox_seccomp.py --baseline REV [--this REV] [--runs 50]
        [--rounds 3]

For each backend (unshare; bwrap where installed and root) and each program (``print(1)``,
``import numpy``), runs ``--runs`` programs one after another with the sandbox of git revision
``--this`` (HEAD by default) and with the one of ``--baseline`` (e.g. the commit before the
filter), each in a fresh process with that revision's ``src`` (its set-up and first program
are not timed), alternating the two ``--rounds`` times so that a busy machine slows both alike;
prints the median programs/s of each as a Markdown table. Revisions, not the work tree, so that
edits in progress elsewhere in the package do not break or change the runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = {"print(1)": "print(1)", "import numpy": "import numpy"}

# Run in a fresh interpreter whose `atgrpo` is the tree on PYTHONPATH: argv = code, runs.
WORKER = """
import sys, time, warnings
warnings.simplefilter("ignore")
from atgrpo.sandbox import SandboxLimits, run_python
code, runs = sys.argv[1], int(sys.argv[2])
limits = SandboxLimits(wall_time_s=30.0, cpu_time_s=30)
first = run_python(code, limits)  # set-up: probes, the root's layout
assert first.ok, first
start = time.perf_counter()
for _ in range(runs):
    r = run_python(code, limits)
    assert r.ok, r
print(runs / (time.perf_counter() - start))
"""


def extract(rev: str, into: Path) -> Path:
    """The ``src`` tree of ``rev``, for PYTHONPATH."""
    into.mkdir()
    archive = into / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def rate(src: Path, backend: str, code: str, runs: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(src), "ATGRPO_SANDBOX": backend}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, code, str(runs)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"error: {backend} {code!r} with {src}: {done.stderr.strip().splitlines()[-1]}")
    return float(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, metavar="REV", help="git revision to compare")
    parser.add_argument("--this", default="HEAD", metavar="REV", help="git revision to measure")
    parser.add_argument("--runs", type=int, default=50, help="programs timed per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of this and baseline")
    args = parser.parse_args()
    revs = [args.this, args.baseline]
    backends = ["unshare"]
    if os.geteuid() == 0 and shutil.which("bwrap"):
        backends.append("bwrap")
    with tempfile.TemporaryDirectory() as tmp:
        trees = [extract(rev, Path(tmp, str(i))) for i, rev in enumerate(revs)]
        print(f"| backend | program | {revs[0]} (programs/s) | {revs[1]} | ratio |")
        print("|---|---|---|---|---|")
        for backend in backends:
            for name, code in PROGRAMS.items():
                rates: list[list[float]] = [[], []]
                for _ in range(args.rounds):
                    for tree, src in enumerate(trees):
                        rates[tree].append(rate(src, backend, code, args.runs))
                this, base = (statistics.median(r) for r in rates)
                print(f"| {backend} | `{name}` | {this:.1f} | {base:.1f} | {this / base:.2f} |")


if __name__ == "__main__":
    main()
