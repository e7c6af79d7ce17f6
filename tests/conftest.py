"""Shared fixtures: an isolated model cache and the tiny random model (no download)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from atgrpo import sandbox

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Tests build models into a private cache, never the user's."""
    cache = tmp_path_factory.mktemp("atgrpo-cache")
    old = os.environ.get("ATGRPO_CACHE")
    os.environ["ATGRPO_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("ATGRPO_CACHE", None)
    else:
        os.environ["ATGRPO_CACHE"] = old


REPO = Path(__file__).resolve().parents[1]


# Every test that needs atgrpo's AVX-512 kernels skips with this in its reason where they do not
# run, and the run's summary counts them (pytest_terminal_summary): on a CPU without AVX-512 the
# default tier does not test the kernels, and says so.
NEEDS_AVX512 = "needs AVX-512"


def require_kernels() -> Any:
    """atgrpo's CPU kernels (atgrpo.generation.cpu), or a skip marked :data:`NEEDS_AVX512`."""
    from atgrpo.generation import cpu

    ext = cpu.extension()
    if ext is None:
        why = "this CPU has none" if not cpu.cpu_supports() else "the kernels did not build"
        pytest.skip(f"{NEEDS_AVX512}: atgrpo's CPU kernels do not run here ({why})")
    return ext


@pytest.fixture(scope="session")
def kernel() -> Any:
    """atgrpo's CPU kernels, or a skip where they do not run (:func:`require_kernels`)."""
    return require_kernels()


def bench_module(name: str) -> Any:
    """``bench/<name>.py`` imported as a module (bench/ on the path: its scripts import each
    other, as bench_packing imports bench_step)."""
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeSandbox:
    """A stand-in for sandbox.run_python that returns a fixed result and records the code."""

    def __init__(self, stdout: str, status: sandbox.ExitStatus = sandbox.ExitStatus.OK) -> None:
        self.stdout, self.status = stdout, status
        self.calls: list[str] = []

    def __call__(
        self, code: str, limits: sandbox.SandboxLimits | None = None
    ) -> sandbox.SandboxResult:
        self.calls.append(code)
        return sandbox.SandboxResult(self.status, self.stdout, "", 0, 0.01)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line: how many tests skipped for want of AVX-512; one line: which sandbox backends
    the run's sandbox tests ran on."""
    avx512 = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if NEEDS_AVX512 in str(getattr(report, "longrepr", ""))
    ]
    if avx512:
        terminalreporter.write_line(
            f"AVX-512: {len(avx512)} tests of atgrpo's CPU kernels skipped ({NEEDS_AVX512}; "
            "this run did not test the kernels)"
        )
    ran: dict[str, int] = {}
    skipped: dict[str, int] = {}
    for key, counts in (("passed", ran), ("failed", ran), ("skipped", skipped)):
        for report in terminalreporter.stats.get(key, []):
            for backend in ("unshare", "bwrap"):
                if f"[{backend}" in getattr(report, "nodeid", ""):
                    counts[backend] = counts.get(backend, 0) + 1
    if not ran and not skipped:
        return
    parts = [
        f"{b} {'ran ' + str(ran[b]) if b in ran else 'skipped'}"
        for b in ("unshare", "bwrap")
        if b in ran or b in skipped
    ]
    hint = "" if "bwrap" in ran else " (make test-sandbox installs bubblewrap and runs both)"
    terminalreporter.write_line(f"sandbox backends: {', '.join(parts)}{hint}")
