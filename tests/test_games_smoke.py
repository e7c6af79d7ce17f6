"""Every game config for the tiny model trains one step end to end (rollout, update, checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atgrpo.config import load_config
from atgrpo.training.loop import train
from conftest import REPO

TINY_GAMES = sorted((REPO / "configs" / "games").glob("*-tiny.yaml"))


def test_every_game_has_tiny_and_default_configs_for_both_workflows() -> None:
    names = {p.stem for p in (REPO / "configs" / "games").glob("*.yaml")}
    for env in ("sudoku", "sokoban"):
        for workflow in ("mas", "single"):
            assert f"{env}-{workflow}" in names
            assert f"{env}-{workflow}-tiny" in names


@pytest.mark.parametrize("path", TINY_GAMES, ids=[p.stem for p in TINY_GAMES])
def test_one_training_step(path: Path, tmp_path: Path) -> None:
    cfg = load_config(path, [f"run.output_dir={tmp_path}", "train.steps=1"])
    result = train(cfg)
    assert result.steps_done == 1
    metrics = json.loads((cfg.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    agents = {"mas": ("tool", "planner"), "single": ("planner",)}[cfg.env.workflow]
    for agent in agents:
        assert f"reward/{agent}/mean" in metrics
    assert (cfg.run_dir / "checkpoints" / "step-000001").is_dir()
