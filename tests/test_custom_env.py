"""Bring your own env: the example examples/guess_env.py passes check_env and scores by its
docstring; configs name env classes by import path (settings under env.kwargs, validated by the
class's config_class) or by a name given to register_env; every mistake is one line naming the
key; a dumped config reloads to the same env; the example trains from its YAML file through the
CLI and from Python, and the Python evaluate returns its report."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from atgrpo import Config, check_env, evaluate, load_config, register_env, train
from atgrpo.checkpoint import ResumeWarning
from atgrpo.config import ConfigError, config_from_raw, dump_config
from atgrpo.envs import (
    ENV_REGISTRY,
    PlanPathEnv,
    PluginEnvConfig,
    TurnBasedEnv,
    make_env,
    resolve_env,
)
from atgrpo.splits import Split, split_of, split_seeds
from conftest import REPO

GUESS_YAML = REPO / "examples" / "guess.yaml"
GUESS = "examples.guess_env:GuessEnv"
# The example on the tiny model, as short as a run gets: 2 steps, 2 tasks, K = 2, 1 turn.
TINY = (
    "model.path=tiny-random-llama",
    "model.precision=fp32",
    "train.steps=2",
    "rollout.num_tasks=2",
    "rollout.num_generations=2",
    "rollout.max_new_tokens=4",
    "env.kwargs.max_turns=1",
    "eval.num_tasks=2",
    "eval.after_training=false",
    "checkpoint.every=0",
)


@pytest.fixture(autouse=True)
def _repo_importable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`examples.guess_env` imports from the repository root, as for a user who runs there."""
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO))
    yield


def guess_module() -> Any:
    import examples.guess_env as module

    return module


def _config(tmp_path: Path, *extra: str) -> Config:
    return load_config(GUESS_YAML, [f"run.output_dir={tmp_path}", *TINY, *extra])


# -- the example env ---------------------------------------------------------------------------


@pytest.mark.parametrize("prime", [False, True])
def test_the_example_passes_check_env(prime: bool) -> None:
    m = guess_module()
    check_env(m.GuessEnv(m.GuessConfig(prime_answers=prime)))
    check_env(m.GuessEnv(), reset_options={"split": "test"})


def test_the_example_scores_as_its_docstring_says() -> None:
    m = guess_module()
    env = m.GuessEnv(m.GuessConfig(high=101, max_turns=3, format_penalty=0.5))
    env.reset(seed=7)
    s = env.secret
    wrong = 1 if s > 1 else 2

    def closeness(g: int) -> float:
        return 1 - abs(g - s) / 100

    advice = env.step(f"Guess: {wrong}")  # the advisor: scored, changes nothing
    assert (advice.team_reward, advice.local_reward, advice.valid) == (0.0, closeness(wrong), True)
    assert f"Your advisor suggests {wrong}." in env.observe("guesser")[1]["content"]
    guess = env.step(f"I say {wrong}")
    assert (guess.team_reward, guess.local_reward) == (0.0, closeness(wrong))
    direction = "higher" if s > wrong else "lower"
    assert f"{wrong} was wrong; the number is {direction}." in env.observe("advisor")[1]["content"]
    invalid = env.step("no idea")
    assert (invalid.local_reward, invalid.valid) == (-0.5, False)
    right = env.step(f"Guess: {s}")
    assert (right.team_reward, right.local_reward, right.valid) == (1.0, 1.0, True)
    assert env.done and env.success and all(env.terminations.values())


def test_the_example_never_trains_on_a_test_secret() -> None:
    m = guess_module()
    env = m.GuessEnv()
    for split in Split:
        for seed in split_seeds(split, 20):
            env.reset(seed=seed, options={"split": split.value})
            assert split_of(env.instance_key) is split


def test_a_truncated_episode_is_not_a_success() -> None:
    m = guess_module()
    env = m.GuessEnv(m.GuessConfig(max_turns=1))
    env.reset(seed=3)
    env.step("garbage")
    env.step(str(env.secret % 100 + 1))  # a wrong guess: s % 100 + 1 != s for s in 1..100
    assert env.done and not env.success and all(env.truncations.values())


# -- naming an env class in a config -----------------------------------------------------------


def test_the_yaml_names_the_class_and_its_settings_are_validated() -> None:
    m = guess_module()
    cfg = load_config(GUESS_YAML)
    assert isinstance(cfg.env, PluginEnvConfig) and cfg.env.name == GUESS
    assert cfg.env.settings == m.GuessConfig(high=100, max_turns=4, prime_answers=True)
    env = make_env(cfg.env)
    assert isinstance(env, m.GuessEnv) and env.workflow.agents == ("advisor", "guesser")


def test_a_dumped_plug_in_config_reloads_to_the_same_env(tmp_path: Path) -> None:
    cfg = load_config(GUESS_YAML, ["env.kwargs.high=50"])
    dumped = dump_config(cfg)
    env = yaml.safe_load(dumped)["env"]
    assert env["name"] == GUESS and env["kwargs"]["high"] == 50
    assert env["kwargs"]["format_penalty"] == 0.5  # defaults written out too
    path = tmp_path / "config.yaml"
    path.write_text(dumped)
    again = load_config(path)
    assert again == cfg and dump_config(again) == dumped


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "env.name=examples.no_such_module:GuessEnv",
            "invalid value for 'env.name': no module named 'examples.no_such_module' on "
            "sys.path or in the working directory",
        ),
        (
            "env.name=examples.guess_env:GuesEnv",
            "invalid value for 'env.name': module 'examples.guess_env' has no 'GuesEnv' "
            "(did you mean 'GuessEnv'?)",
        ),
        (
            "env.name=examples.guess_env:parse_guess",
            "invalid value for 'env.name': 'examples.guess_env:parse_guess' is a function, "
            "not a class",
        ),
        (
            "env.name=examples.guess_env:GuessConfig",
            "invalid value for 'env.name': 'examples.guess_env:GuessConfig' is not an env class: "
            "it lacks reset, observe, step, clone, done, success",
        ),
        ("env.name=plan_pth", "invalid value for 'env.name': unknown env 'plan_pth' (did you mean"),
        (
            "env.kwargs.hihg=5",
            "unknown config key 'env.kwargs.hihg' (did you mean 'env.kwargs.high'?)",
        ),
        ("env.kwargs.high=5", "invalid value for 'env.kwargs.high': Input should be greater than"),
        ("env.high=5", "unknown config key 'env.high' (a plug-in env takes its settings under"),
    ],
)
def test_a_plug_in_mistake_is_one_line_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(GUESS_YAML, [override])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_module_that_fails_to_import_is_one_line(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "broken_env.py").write_text("import not_installed_package\n")
    (tmp_path / "typo_env.py").write_text("x = (\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="importing 'broken_env' failed: it imports"):
        load_config(None, ["env.name=broken_env:Env"])
    with pytest.raises(ConfigError, match="importing 'typo_env' failed: SyntaxError: "):
        load_config(None, ["env.name=typo_env:Env"])


class KeywordEnv(PlanPathEnv):
    """An env class without config_class: its settings are keyword arguments."""

    config_class = None  # type: ignore[assignment]

    def __init__(self, grid_size: int, wall_ratio: float = 0.0) -> None:
        from atgrpo.envs import PlanPathConfig

        super().__init__(PlanPathConfig(grid_size=grid_size, wall_ratio=wall_ratio))


def test_a_class_without_config_class_takes_keyword_arguments() -> None:
    name = f"{__name__}:KeywordEnv"
    cfg = load_config(None, [f"env.name={name}", "env.kwargs.grid_size=3"])
    env = make_env(cfg.env)
    assert isinstance(env, KeywordEnv) and env.config.grid_size == 3
    typo = r"unknown config key 'env\.kwargs\.wall_ratoi' \(did you mean 'env\.kwargs\.wall_ratio'"
    with pytest.raises(ConfigError, match=typo):
        load_config(None, [f"env.name={name}", "env.kwargs.grid_size=3", "env.kwargs.wall_ratoi=0"])
    with pytest.raises(ConfigError, match=r"missing config key 'env\.kwargs\.grid_size'"):
        load_config(None, [f"env.name={name}"])


# -- register_env ------------------------------------------------------------------------------


@pytest.fixture
def registry() -> Iterator[dict[str, Any]]:
    """ENV_REGISTRY, restored after the test (register_env adds to it)."""
    before = dict(ENV_REGISTRY)
    yield ENV_REGISTRY
    ENV_REGISTRY.clear()
    ENV_REGISTRY.update(before)


def test_register_env_gives_a_name_to_a_class(registry: dict[str, Any]) -> None:
    m = guess_module()
    family = register_env("guess", m.GuessEnv)
    assert family.config_class is m.GuessConfig and resolve_env("guess") is family
    cfg = load_config(None, ["env.name=guess", "env.kwargs.high=30"])
    env = make_env(cfg.env)
    assert isinstance(env, m.GuessEnv) and env.config.high == 30
    assert register_env("guess", m.GuessEnv) == family  # again: the same entry
    with pytest.raises(ValueError, match=r"'guess' is already registered to examples\.guess_env"):
        register_env("guess", PlanPathEnv)
    with pytest.raises(ValueError, match="'plan_path' is a built-in env"):
        register_env("plan_path", m.GuessEnv)
    with pytest.raises(ValueError, match="is not an env name"):
        register_env("my:guess", m.GuessEnv)
    with pytest.raises(TypeError, match="is not an env class: it lacks"):
        register_env("other", m.GuessConfig)


def test_an_env_subclassing_turn_based_env_needs_its_own_parts() -> None:
    class Empty(TurnBasedEnv):
        pass

    from atgrpo.envs import Workflow

    env = Empty(Workflow("empty", ("a",), 1))
    env._start_episode()
    with pytest.raises(NotImplementedError, match="Empty must implement _prompt"):
        env.observe("a")
    with pytest.raises(NotImplementedError, match="Empty must implement _act"):
        env.step("x")


# -- training and evaluating the example -------------------------------------------------------


def test_the_example_trains_from_its_yaml_with_the_cli_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from atgrpo.cli import main

    args = [str(GUESS_YAML), f"run.output_dir={tmp_path}", *TINY]
    assert main(["train", *args]) == 0
    lines = (tmp_path / "guess" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert "reward/advisor/mean" in json.loads(lines[0])
    # The run's config.yaml reloads to the same config, and the run resumes under it.
    saved = yaml.safe_load((tmp_path / "guess" / "config.yaml").read_text())
    assert config_from_raw(saved) == _config(tmp_path)
    with pytest.warns(ResumeWarning, match=r"config train\.steps: 2 -> 3"):
        assert main(["train", *args, "train.steps=3", "--resume"]) == 0
    lines = (tmp_path / "guess" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    assert capsys.readouterr().err == ""


def test_the_example_trains_and_evaluates_from_python(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "run.name=py")
    result = train(cfg)
    assert result.steps_done == 2 and result.checkpoint is not None
    report = evaluate(cfg, result.run_dir, num_tasks=2)
    assert report.split == "test" and report.num_tasks == 2
    assert set(report.valid_rate) == {"advisor", "guesser"}
    assert all(t.instance_key and split_of(t.instance_key) is Split.TEST for t in report.tasks)
