"""The GPU check's CPU path (bench/gpu_check.sh --device cpu): every phase a GPU loan would run
(shared policy, resume, two LoRA roles, one FSDP2 rank), on the tiny model, so the script cannot
rot between loans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_the_gpu_check_runs_every_phase_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--device", "cpu", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gpu check: every phase ran" in proc.stdout
    rows = {row["phase"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["build", "shared", "resume", "lora", "sharded"]
    assert (rows["shared"]["steps_done"], rows["resume"]["steps_done"]) == (3.0, 4.0)
    assert rows["lora"]["steps_done"] == 3.0 and rows["shared"]["tokens_per_s"] > 0
    assert rows["sharded"]["skipped"] == 0.0  # the sharded update stepped
