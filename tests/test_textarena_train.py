"""A TextArena game trained for two steps on the tiny model (self-play, and a per-role team
whose second policy is frozen), then played against the random opponent and another run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("textarena")

from atgrpo.cli import main
from atgrpo.config import load_config
from atgrpo.training.loop import train
from conftest import REPO

SELF_PLAY = REPO / "configs" / "textarena" / "kuhn-selfplay-tiny.yaml"
PER_ROLE = REPO / "configs" / "textarena" / "kuhn-per_role-tiny.yaml"
# The tiny random model never writes a legal move, so every group ties; an entropy bonus and
# keeping zero-advantage samples make each step move the trainable weights all the same.
MOVING = ("algo.entropy_coef=0.01", "algo.skip_zero_advantage=false")


def _weights(checkpoint: Path, policy: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = sorted(checkpoint.rglob("model.safetensors"))
    own = [f for f in found if policy in f.parts] or found
    return load_file(str(own[0]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("textarena")
    self_play = train(load_config(SELF_PLAY, [f"run.output_dir={out}", *MOVING]))
    per_role = train(
        load_config(
            PER_ROLE,
            [f"run.output_dir={out}", "policies.second.trainable=false", "checkpoint.keep=2"],
        )
    )
    assert self_play.checkpoint is not None and per_role.checkpoint is not None
    return {"self_play": self_play.run_dir, "per_role": per_role.run_dir}


def test_self_play_and_per_role_train_and_record_invalid_moves(runs: dict[str, Path]) -> None:
    for run in runs.values():
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert len([r for r in rows if "step" in r]) >= 2
        valid = [v for r in rows for k, v in r.items() if k.endswith("/valid")]
        assert valid and all(v == 0.0 for v in valid)  # every move of a random model is invalid
        rates = [v for r in rows for k, v in r.items() if k.endswith("/invalid_move_rate")]
        assert rates and all(v == 1.0 for v in rates)  # and the game's rule says so too
    steps = sorted((runs["per_role"] / "checkpoints").glob("step-*"))
    assert len(steps) == 2
    frozen = [_weights(s, "second") for s in steps]
    assert all(torch.equal(frozen[0][k], frozen[1][k]) for k in frozen[0])


def test_eval_against_the_random_opponent_prints_win_rates_with_intervals(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run = runs["self_play"]
    argv = ["eval", str(run / "config.yaml"), "--checkpoint", str(run), "--num-tasks", "3"]
    assert main([*argv, "--opponent", "random"]) == 0
    out = capsys.readouterr().out
    for seat in ("player_0", "player_1"):
        assert f"shared as {seat}: win 0.0% [0.0, 56.1]  (0 won, 0 drawn, 3 lost" in out
    record = json.loads(next(run.rglob("eval-test-vs-random.json")).read_text())
    assert [s["seat"] for s in record["seats"]] == ["player_0", "player_1"]
    assert record["seats"][0]["interval"] == pytest.approx([0.0, 0.5615], abs=1e-4)


def test_eval_against_another_run_plays_each_policy_in_each_seat(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run, other = runs["per_role"], runs["self_play"]
    argv = ["eval", str(run / "config.yaml"), "--checkpoint", str(run), "--num-tasks", "1"]
    assert main([*argv, "--opponent", str(other)]) == 0
    out = capsys.readouterr().out
    for policy in ("first", "second"):
        for seat in ("player_0", "player_1"):
            assert f"{policy} as {seat}: win" in out


def test_a_game_without_a_rule_is_one_line(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(runs["self_play"] / "config.yaml")
    assert (
        main(["eval", config, "env.game=LiarsDice-v0", "env.game_kwargs={}", "--opponent", "rule"])
        != 0
    )
    err = capsys.readouterr().err
    assert "--opponent rule: no rule-based opponent for LiarsDiceEnv" in err
