"""Code and math MAS train two steps on the tiny model (rollout, sandbox, update, checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atgrpo.config import load_config
from atgrpo.training.loop import train
from conftest import REPO


@pytest.mark.parametrize(
    ("config", "agents"),
    [
        ("code/code-mas-tiny.yaml", ("coder", "tester")),
        ("math/math-mas-tiny.yaml", ("tool", "reasoner")),
    ],
)
def test_mas_trains_two_steps(config: str, agents: tuple[str, ...], tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / config, [f"run.output_dir={tmp_path}"])
    result = train(cfg)
    assert result.steps_done == 2
    lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    for agent in agents:
        assert f"reward/{agent}/mean" in json.loads(lines[-1])
    assert (cfg.run_dir / "checkpoints" / "step-000002").is_dir()


def test_every_domain_has_its_configs() -> None:
    names = {p.relative_to(REPO / "configs").as_posix() for p in (REPO / "configs").rglob("*.yaml")}
    for dom in ("code", "math"):
        for wf in ("mas", "single"):
            assert f"{dom}/{dom}-{wf}.yaml" in names
            assert f"{dom}/{dom}-{wf}-tiny.yaml" in names
    for dom in ("plan_path", "sudoku", "sokoban", "code", "math"):
        assert f"gpu/qwen3-1.7b-{dom}-mas.yaml" in names
