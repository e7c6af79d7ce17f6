"""Evaluation: greedy when n = 1; avg@n and unbiased pass@k when n > 1; swapped-policy eval."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from atgrpo.config import ConfigError, load_config
from atgrpo.envs import Split, make_env, split_seeds
from atgrpo.evaluate import evaluate, pass_at_k
from atgrpo.generation import Generation
from conftest import REPO

FAST = ["rollout.max_prompt_tokens=192", "rollout.max_new_tokens=8"]


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # pass@1 = c / n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 0, 4, 0.0),  # nothing correct
        (4, 3, 2, 1.0),  # n - c < k: every draw of 2 holds a correct one
    ],
)
def test_pass_at_k_matches_hand_computed_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


class OracleGenerator:
    """A planner that solves task i in exactly ``solves[i]`` of its samples (the first ones)."""

    def __init__(self, answers: dict[bytes, str], solves: dict[bytes, int]) -> None:
        self.answers, self.solves = answers, solves
        self.seen: Counter[bytes] = Counter()
        self.temperatures: list[float | None] = []

    def generate(self, prompts, *, max_new_tokens, temperature):
        self.temperatures.append(temperature)
        out = []
        for p in prompts:
            key = bytes(p)
            right = self.seen[key] < self.solves[key]
            self.seen[key] += 1
            text = self.answers[key] if right else "Moves: U U U U U U"
            out.append(Generation([65], [-1.0] if temperature else [], text, finished=True))
        return out


def _encode(messages: list[dict[str, str]]) -> list[int]:
    return list(messages[-1]["content"].encode())


def _oracle(cfg, solves: list[int]) -> OracleGenerator:
    answers, counts = {}, {}
    for seed, c in zip(split_seeds(Split.TEST, len(solves)), solves, strict=True):
        env = make_env(cfg.env)
        env.reset(seed=seed, options={"split": "test"})
        key = bytes(_encode(env.observe("planner")))
        answers[key] = "Moves: " + " ".join(env.oracle_plan())
        counts[key] = c
    return OracleGenerator(answers, counts)


def _evaluate(cfg, gen: OracleGenerator, num_tasks: int):
    with ThreadPoolExecutor(2) as pool:
        return evaluate(
            cfg,
            generators={"shared": gen},
            policy_of={"planner": "shared"},
            encode=_encode,
            split=Split.TEST,
            num_tasks=num_tasks,
            pool=pool,
        )


def test_greedy_evaluation_when_n_is_one() -> None:
    cfg = load_config(REPO / "configs" / "tiny-single.yaml", ["env.max_turns=1"])
    gen = _oracle(cfg, [1, 0, 1])
    report = _evaluate(cfg, gen, 3)
    assert set(gen.temperatures) == {None}  # greedy
    assert report.num_tasks == 3 and report.samples_per_task == 1
    assert report.success_rate == pytest.approx(2 / 3)
    assert report.pass_at == {}
    assert "eval/pass@1" not in report.metrics()


def test_sampled_evaluation_reports_avg_at_n_and_pass_at_k() -> None:
    cfg = load_config(
        REPO / "configs" / "tiny-single.yaml",
        ["env.max_turns=1", "eval.samples_per_task=4", "eval.temperature=0.6", "eval.pass_k=[1,2]"],
    )
    solves = [0, 1, 4]  # correct samples c per task, out of n = 4
    gen = _oracle(cfg, solves)
    report = _evaluate(cfg, gen, 3)
    assert set(gen.temperatures) == {0.6}
    assert sorted(gen.seen.values()) == [4, 4, 4]  # n independent episodes per task
    assert report.num_tasks == 3 and report.samples_per_task == 4
    assert report.success_rate == pytest.approx(5 / 12)  # avg@4: (0 + 1 + 4) / (3 * 4)
    # pass@1 = mean(c / n) = (0 + 0.25 + 1) / 3; pass@2 = (0 + 0.5 + 1) / 3;
    # pass@4 = (0 + 1 + 1) / 3
    assert report.pass_at == pytest.approx({1: 1.25 / 3, 2: 1.5 / 3, 4: 2 / 3})
    metrics = report.metrics()
    assert metrics["eval/avg@4"] == pytest.approx(5 / 12)
    assert metrics["eval/pass@2"] == pytest.approx(0.5)


def test_pass_k_larger_than_n_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"'eval\.pass_k'"):
        load_config(None, ["eval.samples_per_task=2", "eval.pass_k=[4]"])


def test_cli_evaluates_a_per_role_run_with_the_policies_swapped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from atgrpo.cli import main

    lora = str(REPO / "configs" / "tiny-lora.yaml")
    args = [lora, f"run.output_dir={tmp_path}", "run.name=lora", "train.steps=1", *FAST]
    assert main(["train", *args]) == 0
    run = str(tmp_path / "lora")
    assert main(["eval", *args, "--checkpoint", run, "--num-tasks", "2"]) == 0
    swap = ["--swap", "tool,planner"]
    assert main(["eval", *args, "--checkpoint", run, "--num-tasks", "2", *swap]) == 0
    sampled = ["eval.samples_per_task=2", "eval.pass_k=[1]"]
    assert main(["eval", *args, *sampled, "--checkpoint", run, "--num-tasks", "2"]) == 0
    out = capsys.readouterr().out
    assert "L2 one LoRA adapter per policy" in out
    assert "(tool -> tool, planner -> planner)" in out
    assert "(tool -> planner, planner -> tool)" in out
    assert "avg@2, pass@1" in out and "pass@2" in out
    # A config that does not match the checkpoint's policies is one clear line.
    assert main(["eval", str(REPO / "configs" / "tiny.yaml"), "--checkpoint", run]) == 2
    assert "has no policy 'shared' (it has: planner, tool)" in capsys.readouterr().out
