"""Evaluation: greedy when n = 1; avg@n and unbiased pass@k when n > 1; swapped-policy eval."""

from __future__ import annotations

import importlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from atgrpo.config import ConfigError, load_config
from atgrpo.envs import Split, StepOutcome, TurnBasedEnv, Workflow, make_env, split_seeds
from atgrpo.generation import Generation
from atgrpo.training.evaluation import evaluate_held_out, held_out_tasks, pass_at_k
from atgrpo.training.settings import eval_rollout_settings
from conftest import REPO

# atgrpo.training.evaluation is the public function; the module is imported by its name.
evaluate_module = importlib.import_module("atgrpo.training.evaluation")
FAST = ["rollout.max_prompt_tokens=2048", "rollout.max_new_tokens=8"]


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

    def generate(self, prompts, params):
        temperature = params.temperature
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
    # The whole conversation: with primed answers the last message is the same for every task.
    return list("\n".join(m["content"] for m in messages).encode())


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
        return evaluate_held_out(
            cfg,
            generators={"shared": gen},
            policy_of={"planner": "shared"},
            encode=_encode,
            split=Split.TEST,
            num_tasks=num_tasks,
            settings=eval_rollout_settings(cfg, make_env(cfg.env).possible_agents),
            pool=pool,
        )


def test_greedy_evaluation_when_n_is_one() -> None:
    cfg = load_config(REPO / "configs" / "tiny-single.yaml", ["env.max_turns=1"])
    gen = _oracle(cfg, [1, 0, 1])
    report = _evaluate(cfg, gen, 3)
    assert set(gen.temperatures) == {None}  # greedy
    assert report.num_tasks == 3 and report.samples_per_task == 1
    assert report.requested_tasks == 3 and report.note == ""  # enough distinct tasks
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
    # A config that does not match the checkpoint's policies is one clear line: refused by
    # the config comparison, and with --force by the checkpoint's loader.
    assert main(["eval", str(REPO / "configs" / "tiny.yaml"), "--checkpoint", run]) == 2
    err = capsys.readouterr().err
    assert "was trained with another env, model or policies (policies." in err
    assert err.count("\n") == 1
    tiny = str(REPO / "configs" / "tiny.yaml")
    assert main(["eval", tiny, "--checkpoint", run, "--force"]) == 2
    assert "has no policy 'shared' (it has: planner, tool)" in capsys.readouterr().err


# -- every distinct task at most once ------------------------------------------------------------


class FixedAnswer:
    """A generator that gives one answer to every prompt and counts the prompts it sees."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.seen: Counter[bytes] = Counter()

    def generate(self, prompts, params):
        temperature = params.temperature
        self.seen.update(bytes(p) for p in prompts)
        logprobs = [-1.0] if temperature else []
        return [Generation([65], logprobs, self.text, finished=True) for _ in prompts]


def _run(cfg, gen: FixedAnswer, agent: str, num_tasks: int):
    with ThreadPoolExecutor(2) as pool:
        return evaluate_held_out(
            cfg,
            generators={"shared": gen},
            policy_of={agent: "shared"},
            encode=_encode,
            split=Split.TEST,
            num_tasks=num_tasks,
            settings=eval_rollout_settings(cfg, make_env(cfg.env).possible_agents),
            pool=pool,
        )


def _math_config(tmp_path: Path, overrides: list[str]):
    """The math env, reasoner alone, on local files: 3 test problems."""
    import json

    def write(name: str, rows: list[tuple[str, str]]) -> Path:
        path = tmp_path / f"{name}.jsonl"
        lines = [json.dumps({"id": i, "question": q, "answer": a}) for i, (q, a) in enumerate(rows)]
        path.write_text("\n".join(lines) + "\n")
        return path

    train = write("train", [(f"What is {i} + 10?", str(i + 10)) for i in range(20)])
    test = write(
        "test", [("What is 1 + 1?", "2"), ("What is 2 + 2?", "4"), ("What is 3 * 3?", "9")]
    )
    data = [
        "env.data.train=local",
        f"env.data.train_path={train}",
        "env.data.test=local",
        f"env.data.test_path={test}",
        "env.data.validation_percent=50",  # a validation split too, out of 20 problems
    ]
    env = ["env.name=math", "env.workflow=single", "env.max_turns=1"]
    return load_config(None, [*env, *data, *overrides])


def test_a_dataset_split_smaller_than_num_tasks_is_scored_once_per_task(tmp_path: Path) -> None:
    pytest.importorskip("math_verify", reason="the math extra (math-verify) is not installed")
    sampled = ["eval.samples_per_task=2", "eval.temperature=0.6", "eval.pass_k=[1]"]
    cfg = _math_config(tmp_path, sampled)
    envs, seeds, note = held_out_tasks(cfg, Split.TEST, 10)
    keys = [env.instance_key for env in envs]  # type: ignore[attr-defined]
    assert sorted(keys) == [f"local:test/{i}" for i in range(3)]  # each problem once
    assert seeds == split_seeds(Split.TEST, 3)  # the walk stops at the split's size
    assert note == "eval: test split has 3 distinct tasks; asked 10, evaluating 3"

    gen = FixedAnswer("\\boxed{2}")  # right on "1 + 1" only
    report = _run(cfg, gen, "reasoner", 10)
    assert report.num_tasks == 3 and report.requested_tasks == 10 and report.note == note
    assert len(gen.seen) == 3 and sorted(gen.seen.values()) == [2, 2, 2]  # n = 2 per task
    assert report.success_rate == pytest.approx(2 / 6)  # avg@2 over 3 tasks, not 10
    assert report.pass_at == pytest.approx({1: 1 / 3, 2: 1 / 3})


def test_a_small_generated_grid_gives_distinct_tasks_only() -> None:
    # A 2x2 Plan-Path grid with one wall has 24 instances; 4 of them fall in the test split.
    small = ["env.max_turns=1", "env.grid_size=2", "env.wall_ratio=0.25"]
    cfg = load_config(REPO / "configs" / "tiny-single.yaml", small)
    envs, seeds, note = held_out_tasks(cfg, Split.TEST, 10)
    keys = [env.instance_key for env in envs]  # type: ignore[attr-defined]
    assert len(keys) == len(set(keys)) == 4
    assert len(set(seeds)) == 4
    draws = evaluate_module.MAX_DRAWS_PER_TASK * 10
    assert note == f"eval: {draws} seeds of the test split gave 4 distinct tasks; asked 10, " + (
        "evaluating 4"
    )

    gen = FixedAnswer("Moves: U")
    report = _run(cfg, gen, "planner", 10)
    assert report.num_tasks == 4 and report.requested_tasks == 10
    assert sorted(gen.seen.values()) == [1, 1, 1, 1]  # one greedy episode per distinct task


class SeedEcho(TurnBasedEnv):
    """One agent, one turn, and no ``instance_key``: each seed counts as a task of its own."""

    def __init__(self) -> None:
        super().__init__(Workflow(name="echo", agents=("planner",), max_turns=1))

    def reset(self, seed=None, options=None) -> None:
        self._seed, self._split = seed, self._split_option(options)
        self._start_episode()

    def observe(self, agent_id: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"task {self._seed}"}]

    def step(self, action: str) -> StepOutcome:
        self._advance(task_over=True)
        return StepOutcome(team_reward=1.0, local_reward=1.0, valid=True)

    @property
    def success(self) -> bool:
        return self.done


def test_an_env_without_instance_key_is_deduplicated_by_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(evaluate_module, "make_env", lambda _cfg: SeedEcho())
    cfg = load_config(REPO / "configs" / "tiny-single.yaml")
    envs, seeds, note = held_out_tasks(cfg, Split.TEST, 5)
    assert seeds == split_seeds(Split.TEST, 5) and len(envs) == 5 and note == ""
    report = _run(cfg, FixedAnswer("done"), "planner", 5)
    assert report.num_tasks == 5 and report.success_rate == 1.0


def test_num_tasks_must_be_positive() -> None:
    cfg = load_config(REPO / "configs" / "tiny-single.yaml")
    with pytest.raises(ValueError, match="num_tasks must be >= 1"):
        held_out_tasks(cfg, Split.TEST, 0)


def test_the_shortfall_note_is_printed_by_the_cli_and_kept_in_the_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from atgrpo.cli import _print_eval
    from atgrpo.experiments.tables import TableCell, markdown_table
    from atgrpo.training.evaluation import EvalReport, TaskResult

    note = "eval: test split has 30 distinct tasks; asked 100, evaluating 30"
    tasks = [TaskResult(i, i, None, i % 2, 1, 0.0) for i in range(30)]
    report = EvalReport("test", 30, 0.5, 0.0, requested_tasks=100, note=note, tasks=tasks)
    _print_eval("aime24", report)
    out = capsys.readouterr().out
    assert "on 30 test tasks" in out and note in out
    md = markdown_table([TableCell("Single agent", "AIME24", [report], [""], "configs/x.yaml")])
    assert f"AIME24: {note}" in md
    _print_eval("full", EvalReport("test", 30, 0.5, 0.0, requested_tasks=30))
    assert "eval:" not in capsys.readouterr().out


def test_cli_eval_ablates_an_agent_into_its_own_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from atgrpo.cli import main

    tiny = str(REPO / "configs" / "tiny.yaml")
    args = [tiny, f"run.output_dir={tmp_path}", "run.name=base", *FAST, "--num-tasks", "2"]
    assert main(["eval", *args]) == 0
    assert main(["eval", *args, "--ablate", "tool"]) == 0
    assert sorted(p.name for p in (tmp_path / "base").glob("eval-*.json")) == [
        "eval-test-ablate-tool.json",
        "eval-test.json",
    ]
    capsys.readouterr()
    assert main(["eval", *args, "--ablate", "coder"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'eval.ablate': the env has no agent 'coder'" in err
