"""The dataset env (env.name: dataset): prompts from a JSONL or parquet file, scored by reward
functions in TRL's signature named by import path; single agent or tool agent + answerer.

Scored as its docstring says, split as the file says (or by the prompt's hash) without a prompt
in two splits, passes check_env (also through `atgrpo check-env`, on the shipped configs), trains
on the tiny model from a JSONL this test writes and reward functions of this module, and every
mistake (a missing file, a bad import path, a reward function that raises or returns the wrong
length, NaN or a string) is one line naming the problem and the fix."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from atgrpo import check_env, sandbox
from atgrpo.config import Config, ConfigError, config_from_raw
from atgrpo.envs import DatasetEnv, DatasetEnvError, EnvError, make_env
from atgrpo.envs.base import env_call
from atgrpo.splits import Split, split_of, split_seeds
from conftest import REPO, FakeSandbox

MODULE = __name__  # this module, as reward functions' import path: "<MODULE>:correct"


# -- reward functions in TRL's signature ---------------------------------------------------------


def _text(completion: Any) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    out = []
    for completion, truth in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d+", _text(completion)[-200:])
        out.append(1.0 if numbers and numbers[-1] == str(truth) else 0.0)
    return out


def short(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """0.5 for a short answer; None (does not apply) for an empty one."""
    return [None if not _text(c) else 0.5 if len(_text(c)) < 20 else 0.0 for c in completions]


def seen_kwargs(completions: list[Any], **kwargs: Any) -> list[float]:
    SEEN.append({"completions": completions, **kwargs})
    return [0.0] * len(completions)


def raises(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0 / 0 for _ in completions]


def two_values(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0, 1.0]


def nan(completions: list[Any], **kwargs: Any) -> list[float]:
    return [math.nan for _ in completions]


def text(completions: list[Any], **kwargs: Any) -> list[str]:
    return ["good" for _ in completions]


def positional_only(completions: list[Any]) -> list[float]:
    return [0.0 for _ in completions]


SEEN: list[dict[str, Any]] = []


def write_rows(path: Path, n: int = 40, split: bool = False) -> Path:
    with path.open("w") as f:
        for i in range(n):
            row: dict[str, Any] = {"prompt": f"What is {i} + {i + 1}?", "answer": 2 * i + 1}
            if split:
                row["split"] = ("train", "train", "validation", "test")[i % 4]
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_rows(tmp_path / "prompts.jsonl")


def make_config(path: Path, **env: Any) -> Config:
    section = {"name": "dataset", "path": str(path), "reward_funcs": [f"{MODULE}:correct"], **env}
    return config_from_raw({"model": {"path": "tiny-random-llama"}, "env": section})


def make(path: Path, **env: Any) -> DatasetEnv:
    built = make_env(make_config(path, **env).env)
    assert isinstance(built, DatasetEnv)
    return built


@pytest.fixture(autouse=True)
def _seen() -> Iterator[None]:
    SEEN.clear()
    yield


# -- scoring -------------------------------------------------------------------------------------


def test_the_answer_is_scored_by_the_weighted_reward_functions(data: Path) -> None:
    env = make(data, reward_funcs=[f"{MODULE}:correct", f"{MODULE}:short"], reward_weights=[2, 1])
    env.reset(seed=0)
    truth = env.row.columns["answer"]
    outcome = env.step(f"It is {truth}")
    assert outcome.team_reward == outcome.local_reward == 2 * 1.0 + 0.5
    assert outcome.info["rewards"] == {f"{MODULE}:correct": 1.0, f"{MODULE}:short": 0.5}
    assert env.success and env.done  # 2.5 >= the default threshold 1.0
    env.reset(seed=0)
    outcome = env.step("")  # short() does not apply (None): it adds nothing
    assert outcome.team_reward == 0.0 and not outcome.valid and not env.success


def test_success_is_the_designated_function_passing_the_threshold(data: Path) -> None:
    funcs = [f"{MODULE}:correct", f"{MODULE}:short"]
    env = make(data, reward_funcs=funcs, success_func=f"{MODULE}:correct", success_threshold=1.0)
    env.reset(seed=1)
    assert env.step("no idea").local_reward == 0.5 and not env.success  # short, not correct
    env = make(data, reward_funcs=funcs, success_threshold=0.5)  # the weighted reward decides
    env.reset(seed=1)
    env.step("no idea")
    assert env.success


def test_reward_functions_get_trl_s_arguments(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    row = {"prompt": [{"role": "user", "content": "Say 3."}], "answer": 3, "level": "easy"}
    path.write_text(json.dumps({**row, "split": "train"}) + "\n")
    env = make(path, reward_funcs=[f"{MODULE}:seen_kwargs"])
    env.reset(seed=0)
    assert env.observe("answerer") == row["prompt"]
    env.step("3")
    (call,) = SEEN
    # A conversational prompt gives TRL's conversational completions; every other column is
    # a keyword argument, a list of one value per completion.
    assert call["completions"] == [[{"role": "assistant", "content": "3"}]]
    assert call["prompts"] == [row["prompt"]]
    assert call["answer"] == [3] and call["level"] == ["easy"] and call["split"] == ["train"]


def test_a_later_turn_shows_the_previous_answer(data: Path) -> None:
    env = make(data, max_turns=2, system_prompt="Be brief.")
    env.reset(seed=2)
    first = env.observe("answerer")
    assert first[0] == {"role": "system", "content": "Be brief."}
    env.step("wrong")
    assert not env.done
    later = env.observe("answerer")[-1]["content"]
    assert later.endswith("Turn 2 of 2. The last answer was:\nwrong\nIt scored 0; answer again.")


# -- the tool agent ------------------------------------------------------------------------------


def test_the_tool_s_program_is_run_and_shown_to_the_answerer(data: Path) -> None:
    env = make(data, workflow="mas", prime_answers=True)
    assert env.possible_agents == ("tool", "answerer") and env.workflow.defers_team == ("tool",)
    env.reset(seed=0)
    truth = env.row.columns["answer"]
    assert env.observe("tool")[-1] == {"role": "assistant", "content": "```python\n"}
    run = FakeSandbox(f"{truth}\n")
    with mock.patch.object(sandbox, "run_python", run):
        outcome = env.step("print(1)\n```")
    assert run.calls == ["print(1)"]
    assert outcome.local_reward == 1.0 and outcome.team_reward == 0.0  # R(printout); no answer
    shown = env.observe("answerer")[-1]["content"]
    assert f"```python\nprint(1)\n```\nIt printed:\n{truth}" in shown
    assert env.step(str(truth)).team_reward == 1.0 and env.success
    env = make(data, workflow="mas")  # not primed: a completion without a code block
    env.reset(seed=0)
    outcome = env.step("no code at all")
    assert outcome.local_reward == -0.5 and not outcome.valid
    assert outcome.info["parse_error"] == "no code block"


def test_the_tool_runs_under_the_env_s_sandbox_settings(data: Path) -> None:
    env = make(data, workflow="mas", sandbox_wall_time_s=1.5, sandbox_packages=["numpy"])
    env.reset(seed=0)
    seen: list[sandbox.SandboxLimits] = []

    def fake(code: str, limits: sandbox.SandboxLimits | None = None) -> sandbox.SandboxResult:
        assert limits is not None
        seen.append(limits)
        return sandbox.SandboxResult(sandbox.ExitStatus.OK, "1\n", "", 0, 0.0)

    with mock.patch.object(sandbox, "run_python", fake):
        env.step("```python\nprint(1)\n```")
    assert seen[0].wall_time_s == 1.5 and seen[0].packages == ("numpy",)


# -- splits --------------------------------------------------------------------------------------


def test_without_a_split_column_the_prompt_s_hash_splits(data: Path) -> None:
    env = make(data)
    sizes = {s: env.num_instances(s) for s in Split}
    assert sum(sizes.values()) == 40 and sizes[Split.TRAIN] > sizes[Split.TEST] > 0
    for split in Split:
        for seed in split_seeds(split, sizes[split]):
            env.reset(seed=seed, options={"split": split})
            assert split_of(env.instance_key) is split


def test_a_split_column_decides_and_a_test_prompt_is_never_trained_on(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "split.jsonl", n=12, split=True)
    with path.open("a") as f:  # a test prompt repeated as a training row, and a duplicate
        f.write(json.dumps({"prompt": "What is 3 + 4?", "answer": 7, "split": "train"}) + "\n")
        f.write(json.dumps({"prompt": "What is 0 + 1?", "answer": 1, "split": "train"}) + "\n")
    with pytest.warns(UserWarning, match="1 rows repeat a test prompt"):
        env = make(path)
    assert [env.num_instances(s) for s in Split] == [6, 3, 3]
    keys = {}
    for split in Split:
        for seed in split_seeds(split, env.num_instances(split)):
            env.reset(seed=seed, options={"split": split})
            keys.setdefault(env.instance_key, set()).add(split)
    assert all(len(splits) == 1 for splits in keys.values()) and len(keys) == 12


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow")
def test_a_parquet_file_reads_like_the_jsonl(tmp_path: Path, data: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "prompts.parquet")
    a, b = make(data), make(tmp_path / "prompts.parquet")
    for seed in range(5):
        a.reset(seed=seed)
        b.reset(seed=seed)
        assert a.observe("answerer") == b.observe("answerer")


@pytest.mark.parametrize("workflow", ["single", "mas"])
def test_it_passes_check_env(data: Path, workflow: str) -> None:
    cfg = make_config(data, workflow=workflow, reward_funcs=[f"{MODULE}:correct"])
    check_env(make_env(cfg.env), factory=lambda: make_env(cfg.env))


def test_the_shipped_configs_pass_atgrpo_check_env(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from atgrpo.cli import main

    monkeypatch.chdir(REPO)  # the configs name examples/arith.jsonl and examples.rewards
    monkeypatch.syspath_prepend(str(REPO))
    for name in ("dataset-arith.yaml", "dataset-arith-mas.yaml"):
        assert main(["check-env", str(REPO / "configs" / name), "--seeds", "2"]) == 0
    assert capsys.readouterr().out.count("passed") == 2


# -- mistakes: one line each ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"path": "missing.jsonl"}, r"'env.path': .*no file 'missing.jsonl'.*give the path of"),
        (
            {"path": "prompts.csv"},
            r"'env.path': .*not a \.jsonl, \.jsonl\.gz, \.json, \.parquet file",
        ),
        ({"reward_funcs": ["nomodule:f"]}, r"'env.reward_funcs': .*no module named 'nomodule'"),
        ({"reward_funcs": [f"{MODULE}:corect"]}, rf"has no 'corect' \(did you mean '{MODULE}"),
        ({"reward_funcs": ["correct"]}, r"not an import path; name the function 'module:func"),
        ({"reward_funcs": []}, r"'env.reward_funcs': List should have at least 1 item"),
        ({"reward_weights": [1, 2]}, r"'env.reward_weights': .*2 weights for 1 reward_funcs"),
    ],
)
def test_a_config_mistake_is_one_line_naming_the_key(
    data: Path, env: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(data.parent)
    section = {"name": "dataset", "path": str(data), "reward_funcs": [f"{MODULE}:correct"], **env}
    with pytest.raises(ConfigError, match=message) as info:
        config_from_raw({"env": section})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a", "answer": 1}\nnot json\n', r"prompts.jsonl:2: not JSON .*one JSON obj"),
        ('{"question": "a"}\n', r":1: no 'prompt' column .*set env.prompt_field"),
        ('{"prompt": 3}\n', r":1: 'prompt' must be a non-empty string or a list of chat"),
        ('{"prompt": "a", "split": "dev"}\n', r"'split' is 'dev'; use train, validation or test"),
        ('{"prompt": "a", "split": "test"}\n', r"no training prompts; give rows with split=tra"),
    ],
)
def test_a_bad_file_is_one_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetEnvError, match=message) as info:
        make(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("two_values", r"'\S+:two_values' returned 2 values for 1 completion; return a list"),
        ("nan", r"'\S+:nan' returned nan for a completion; return finite floats"),
        ("text", r"'\S+:text' returned str 'good' as a reward; return floats"),
    ],
)
def test_a_reward_function_that_returns_a_wrong_value_is_one_line(
    data: Path, function: str, message: str
) -> None:
    env = make(data, reward_funcs=[f"{MODULE}:{function}"])
    env.reset(seed=0)
    with pytest.raises(DatasetEnvError, match=message) as info, env_call(env, "step"):
        env.step("1")
    assert "\n" not in str(info.value)


def test_a_reward_function_that_raises_is_named_with_its_line(data: Path) -> None:
    env = make(data, reward_funcs=[f"{MODULE}:raises"])
    env.reset(seed=0)
    with pytest.raises(EnvError) as info, env_call(env, "step"):
        env.step("1")
    line = next(
        i for i, x in enumerate(Path(__file__).read_text().splitlines(), 1) if "1.0 / 0" in x
    )
    assert str(info.value) == (
        "env DatasetEnv.score raised ZeroDivisionError: float division by zero in "
        f"{MODULE}:raises() (tests/test_dataset_env.py:{line})"
    )


def test_a_reward_function_without_kwargs_is_refused_at_start(data: Path) -> None:
    with pytest.raises(DatasetEnvError, match=r"cannot take the arguments .*def f\(completions"):
        make(data, reward_funcs=[f"{MODULE}:positional_only"])


def test_the_cli_says_a_reward_function_s_fault_in_one_line(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from atgrpo.cli import main

    args = _train_args(data, tmp_path, f"env.reward_funcs=[{MODULE}:nan]")
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: reward function") and "returned nan" in err
    assert len(err.splitlines()) == 1


# -- training on the tiny model ------------------------------------------------------------------


def _train_args(data: Path, out: Path, *more: str) -> list[str]:
    return [
        str(REPO / "configs" / "dataset-tiny.yaml"),
        f"run.output_dir={out}",
        "run.name=dataset",
        "env.name=dataset",
        f"env.path={data}",
        f"env.reward_funcs=[{MODULE}:correct,{MODULE}:short]",
        "train.steps=1",
        "rollout.num_tasks=2",
        "rollout.num_generations=2",
        "rollout.max_new_tokens=4",
        "eval.num_tasks=2",
        *more,
    ]


@pytest.mark.parametrize("workflow", ["single", "mas"])
def test_it_trains_on_the_tiny_model_from_a_jsonl_and_a_reward_function(
    data: Path, tmp_path: Path, workflow: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from atgrpo.cli import main

    out = tmp_path / "runs"
    assert main(["train", *_train_args(data, out, f"env.workflow={workflow}")]) == 0
    (line,) = (out / "dataset" / "metrics.jsonl").read_text().splitlines()
    metrics = json.loads(line)
    assert metrics["step"] == 1 and "reward/answerer/mean" in metrics
    assert ("reward/tool/mean" in metrics) is (workflow == "mas")
    samples = [json.loads(x) for x in (out / "dataset" / "samples.jsonl").read_text().splitlines()]
    keys = {s["instance_key"] for s in samples}
    assert len(keys) == 2 and all(split_of(k) is Split.TRAIN for k in keys)  # hash-split file


def test_a_missing_key_is_one_line_naming_it_and_what_it_holds() -> None:
    from atgrpo.config import ConfigError, config_from_raw

    with pytest.raises(ConfigError) as info:
        path = Path(__file__).resolve().parents[1] / "examples" / "arith.jsonl"
        config_from_raw({"env": {"name": "dataset", "path": str(path)}})
    message = str(info.value)
    assert message.startswith("missing config key 'env.reward_funcs': Reward functions as")
    assert message.endswith("set it in the config file or as env.reward_funcs=...")
    assert "\n" not in message
