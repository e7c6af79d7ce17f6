"""The Countdown env (tests/countdown_env.py): check_env, one training step, a 2-task eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atgrpo import check_env, evaluate, load_config
from atgrpo.cli import main
from atgrpo.splits import Split

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """`env.name: countdown_env:CountdownEnv` imports from this folder."""
    monkeypatch.syspath_prepend(str(HERE))


def _config_file(tmp_path: Path) -> Path:
    """A tiny-model config of the env (the shape of configs/tiny.yaml)."""
    text = f"""
run:
  name: countdown
  output_dir: {tmp_path / "runs"}
  seed: 0
model:
  path: tiny-random-llama
  precision: fp32
env:
  name: countdown_env:CountdownEnv
  kwargs:
    workflow: mas
    max_turns: 1
    prime_answers: true
    sandbox_wall_time_s: 2.0
    max_code_chars_shown: 200
    max_output_chars_shown: 60
rollout:
  num_tasks: 2
  num_generations: 2
  max_new_tokens: 8
  max_prompt_tokens: 1024
train:
  steps: 1
  warmup_steps: 0
  lr: 1.0e-3
  micro_batch_size: 4
eval:
  every: 0
  num_tasks: 2
checkpoint:
  every: 1
  keep: 2
"""
    path = tmp_path / "countdown.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("workflow", ["mas", "single"])
def test_check_env(workflow: str) -> None:
    from countdown_env import CountdownConfig, CountdownEnv

    def factory() -> CountdownEnv:
        return CountdownEnv(CountdownConfig(workflow=workflow))

    env = factory()
    check_env(env, factory=factory)
    check_env(factory(), reset_options={"split": "test"}, factory=factory)
    agents = ("tool", "solver") if workflow == "mas" else ("solver",)
    assert tuple(env.possible_agents) == agents


def test_rewards_by_hand() -> None:
    from countdown_env import CountdownEnv, check_expression

    env = CountdownEnv()
    env.reset_to(((2, 3, 7), 17))
    outcome = env.step("```python\nprint('2 + 3 * 5')\n```")  # 5 is not given
    assert (outcome.team_reward, outcome.local_reward, outcome.valid) == (0.0, -0.5, False)
    outcome = env.step("Expression: 3 * 7 - 2 - 2")  # 2 used twice
    assert (outcome.team_reward, outcome.valid, env.success) == (0.0, False, False)
    env.reset_to(((2, 3, 7), 17))
    outcome = env.step("```python\nprint(3 * 7)\n```")  # prints 21: 21 is not given
    assert (outcome.team_reward, outcome.local_reward, outcome.valid) == (0.0, -0.5, False)
    outcome = env.step("Expression: 3 * 7")  # valid, misses
    assert (outcome.team_reward, outcome.local_reward, outcome.valid) == (0.0, 0.0, True)
    env.reset_to(((2, 3, 7), 17))
    env.step("```python\nprint('7 * 2 + 3')\n```")
    outcome = env.step("Let me see.\nExpression: 7 * 2 + 3")
    assert (outcome.team_reward, outcome.local_reward, outcome.valid) == (1.0, 1.0, True)
    assert env.success and env.done
    assert check_expression("(8 / (3 - 8 / 3))", (8, 3, 8, 3))[0] == 24
    assert check_expression("1 + " * 100 + "1", (1,))[0] is None


def test_splits_are_disjoint_and_deterministic() -> None:
    from countdown_env import CountdownConfig, draw_instance, instance_key

    config = CountdownConfig()
    keys = {
        split: {instance_key(draw_instance(config, seed, split)) for seed in range(200)}
        for split in Split
    }
    assert not keys[Split.TRAIN] & keys[Split.VALIDATION]
    assert not keys[Split.TRAIN] & keys[Split.TEST]
    assert not keys[Split.VALIDATION] & keys[Split.TEST]
    assert draw_instance(config, 5, Split.TEST) == draw_instance(config, 5, Split.TEST)


def test_train_one_step_then_evaluate(tmp_path: Path) -> None:
    config = _config_file(tmp_path)
    assert main(["check-env", str(config), "--seeds", "2"]) == 0
    assert main(["train", str(config)]) == 0
    run_dir = tmp_path / "runs" / "countdown"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records if "reward/solver/mean" in r] == [1]
    assert "reward/tool/mean" in records[0]

    cfg = load_config(str(config))
    report = evaluate(cfg, run_dir, num_tasks=2)
    assert report.num_tasks == 2 and report.split in ("test", Split.TEST)
    assert 0.0 <= report.success_rate <= 1.0
    assert main(["eval", str(config), "--checkpoint", str(run_dir), "--num-tasks", "2"]) == 0
    assert list(run_dir.glob("checkpoints/step-*/eval-test.json"))
