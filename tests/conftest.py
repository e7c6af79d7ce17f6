"""Shared fixtures: an isolated model cache and the tiny random model (no download)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

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
