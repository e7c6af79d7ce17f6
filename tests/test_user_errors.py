"""Errors that say whose fault (issue 25): an exception of a user's env (its ``__init__``,
``reset``, ``_act``, or a reward function it calls) reaches the CLI user as one line naming the
env class, the method and the user's file:line; ``--verbose`` shows the traceback; from Python
it is an ``EnvError`` whose cause is the user's exception."""

from __future__ import annotations

import pickle
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from atgrpo.cli import main
from atgrpo.envs import EnvError

MODULE = "user_broken_env"
SOURCE = textwrap.dedent(
    """
    from atgrpo.envs import PlanPathEnv


    def reward(text):
        return len(text) / 0  # LINE reward


    class BrokenInit(PlanPathEnv):
        def __init__(self, config):
            super().__init__(config)
            settings = {}
            self.numbers = settings["numbers"]  # LINE init


    class BrokenReset(PlanPathEnv):
        def reset(self, seed=None, options=None):
            problem = {"target": 24}
            self.numbers = problem["numbers"]  # LINE reset


    class BrokenAct(PlanPathEnv):
        def _act(self, agent_id, text):
            outcome, over = super()._act(agent_id, text)
            return outcome, reward(text) > 0 or over
    """
)
CONFIG = """
run: {{name: broken, output_dir: {out}}}
model: {{path: tiny-random-llama, precision: fp32}}
env: {{name: "{module}:{cls}", kwargs: {{workflow: single, grid_size: 4, max_turns: 1}}}}
rollout: {{num_tasks: 1, num_generations: 2, max_new_tokens: 2, max_prompt_tokens: 2048}}
train: {{steps: 1}}
eval: {{before_training: false, after_training: false, num_tasks: 1}}
checkpoint: {{every: 0}}
"""


def line(marker: str) -> int:
    return next(i for i, text in enumerate(SOURCE.splitlines(), 1) if f"# LINE {marker}" in text)


@pytest.fixture()
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The user's folder, the working directory: their env module and a config per class."""
    (tmp_path / f"{MODULE}.py").write_text(SOURCE, encoding="utf-8")
    for cls in ("BrokenInit", "BrokenReset", "BrokenAct"):
        text = CONFIG.format(out=tmp_path / "runs", module=MODULE, cls=cls)
        (tmp_path / f"{cls}.yaml").write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    import sys

    sys.modules.pop(MODULE, None)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("cls", "method", "error", "marker"),
    [
        ("BrokenInit", "__init__", "KeyError: 'numbers'", "init"),
        ("BrokenReset", "reset", "KeyError: 'numbers'", "reset"),
        ("BrokenAct", "_act", "ZeroDivisionError: division by zero in reward()", "reward"),
    ],
)
def test_an_exception_in_the_users_env_is_one_line_naming_it(
    user_dir: Path,
    capsys: pytest.CaptureFixture[str],
    cls: str,
    method: str,
    error: str,
    marker: str,
) -> None:
    code, err = run(capsys, "train", f"{cls}.yaml")
    assert code == 1
    assert err == (
        f"error: env {cls}.{method} raised {error} ({MODULE}.py:{line(marker)}); "
        "run with --verbose for the traceback\n"
    )


def test_eval_names_the_env_too_and_verbose_shows_the_traceback(
    user_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(capsys, "eval", "BrokenReset.yaml")
    assert code == 1 and err.startswith("error: env BrokenReset.reset raised KeyError: 'numbers'")
    assert err.count("\n") == 1
    code, err = run(capsys, "eval", "BrokenReset.yaml", "--verbose")
    assert code == 1 and err.startswith("Traceback (most recent call last):")
    assert f'{MODULE}.py", line {line("reset")}, in reset' in err
    assert "The above exception was the direct cause" in err
    assert "EnvError: env BrokenReset.reset raised KeyError: 'numbers'" in err


def test_from_python_it_is_an_env_error_caused_by_the_users_exception(user_dir: Path) -> None:
    from atgrpo import load_config, train

    with pytest.raises(EnvError) as caught:
        train(load_config(user_dir / "BrokenAct.yaml"))
    exc = caught.value
    assert (exc.env_class, exc.method, exc.function) == ("BrokenAct", "_act", "reward")
    assert exc.where == f"{MODULE}.py:{line('reward')}" and not exc.ours
    assert isinstance(exc.__cause__, ZeroDivisionError)
    again = pickle.loads(pickle.dumps(exc))  # Ray env workers send it back by pickle
    assert str(again) == str(exc)


def test_atgrpos_own_errors_pass_unchanged() -> None:
    from atgrpo.data.base import DatasetError
    from atgrpo.envs.base import env_call

    with pytest.raises(DatasetError), env_call(object(), "reset"):
        raise DatasetError("no such dataset: give env.data_path")


def test_a_bug_in_atgrpo_is_said_to_be_ours() -> None:
    from atgrpo.envs import PlanPathConfig, PlanPathEnv
    from atgrpo.envs.base import env_call

    env = PlanPathEnv(PlanPathConfig())
    with pytest.raises(EnvError) as caught, env_call(env, "reset"):
        env.reset(options={"split": "train", "bogus": 1})  # TurnBasedEnv refuses the option
    assert caught.value.ours and caught.value.where.startswith("atgrpo/envs/base.py:")
    assert str(caught.value).endswith(": an error in atgrpo itself, please report it")
