"""``atgrpo eval`` refuses a checkpoint trained with another env, model or policies than its
config (as ``--resume`` does; ``--force`` overrides), and ``eval-<split>.json`` records the
config and env it measured without overwriting an evaluation of another config (issue 25)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atgrpo import evaluate, load_config
from atgrpo.cli import main
from atgrpo.config import ConfigError
from atgrpo.training.evaluation import FIXED_ON_EVAL, config_hash
from atgrpo.training.run_dir import FIXED_ON_RESUME
from conftest import REPO

TINY = str(REPO / "configs" / "tiny.yaml")
FAST = ["rollout.max_prompt_tokens=2048", "rollout.max_new_tokens=8", "train.steps=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """A one-step tiny run: the arguments it was trained with and its checkpoint."""
    out = tmp_path_factory.mktemp("runs")
    args = [TINY, f"run.output_dir={out}", "run.name=r", *FAST]
    assert main(["train", *args]) == 0
    return args, out / "r" / "checkpoints" / "step-000001"


def _eval(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_eval_refuses_another_model_env_or_policies(
    run: tuple[list[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args, checkpoint = run
    for change, shown in [
        ("model.path=smollm2-135m-instruct", 'model.path: "tiny-random-llama" -> "smollm2'),
        ("env.workflow=single", 'env.workflow: "mas" -> "single"'),
    ]:
        code, out, err = _eval(capsys, *args, change, "--checkpoint", str(checkpoint))
        assert (code, out) == (2, ""), err
        assert err.startswith(f"error: checkpoint {checkpoint} was trained with another env, ")
        assert shown in err and err.count("\n") == 1
        assert err.rstrip().endswith("or pass --force to evaluate it anyway")
        assert str(checkpoint.parents[1] / "config.yaml") in err
    cfg = load_config(TINY, [*args[1:], "env.workflow=single"])
    with pytest.raises(ConfigError, match="was trained with another env"):
        evaluate(cfg, checkpoint)


def test_eval_records_its_config_and_keeps_an_evaluation_of_another_config(
    run: tuple[list[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args, checkpoint = run
    swap = ["routing.tool=shared"]  # routing may differ (the swapped-roles evaluation)
    code, out, _ = _eval(capsys, *args, *swap, "--checkpoint", str(checkpoint), "--num-tasks", "1")
    assert code == 0
    first = checkpoint / "eval-test.json"
    record = json.loads(first.read_text())
    cfg = load_config(TINY, [*args[1:], *swap, "eval.num_tasks=1"])
    assert record["config_hash"] == config_hash(cfg) and record["config"]["eval"]["num_tasks"] == 1
    assert record["env"]["name"] == "plan_path" and record["checkpoint"] == str(checkpoint)
    assert record["models"] == {"shared": "tiny-random-llama"}
    # The same config again replaces it; another config (here --num-tasks) goes beside it.
    assert _eval(capsys, *args, *swap, "--checkpoint", str(checkpoint), "--num-tasks", "1")[0] == 0
    assert sorted(p.name for p in checkpoint.glob("eval-*.json")) == ["eval-test.json"]
    code, out, _ = _eval(capsys, *args, "--checkpoint", str(checkpoint), "--num-tasks", "2")
    other = load_config(TINY, [*args[1:], "eval.num_tasks=2"])
    kept = checkpoint / f"eval-test-{config_hash(other)}.json"
    assert code == 0 and kept.is_file() and f"per-task results: {kept}" in out
    assert "eval-test.json holds an evaluation of another config: kept" in out
    assert json.loads(first.read_text()) == record


def test_force_evaluates_another_env(
    run: tuple[list[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args, checkpoint = run
    change = ["env.workflow=single", "--num-tasks", "1", "--force"]
    code, out, err = _eval(capsys, *args, *change, "--checkpoint", str(checkpoint))
    assert code == 0 and "on 1 test tasks" in out, err
    assert "--force" in err or err == ""  # nothing refused


def test_eval_and_resume_compare_in_one_place() -> None:
    assert set(FIXED_ON_EVAL) == set(FIXED_ON_RESUME) - {"routing"}
