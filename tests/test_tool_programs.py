"""Tool programs (atgrpo.envs.tool, docs/custom-env.md "Running model-written code"): the
program is taken out of a completion and run in the sandbox under the env's limits and packages;
the texts of the ProgramRun are the same in every run and every sandbox mode (no temporary
paths, no object addresses); the built-in families run their tool through it; and the worked
tool-agent env of docs/custom-env.md passes check_env."""

from __future__ import annotations

import os
import random
import tempfile
from typing import Any, ClassVar
from unittest import mock

import pytest
from pydantic import Field, ValidationError

from atgrpo import check_env, sandbox
from atgrpo.envs import (
    Message,
    ProgramRun,
    SandboxSettings,
    StepOutcome,
    TurnBasedEnv,
    Workflow,
    normalise_program_text,
    run_program,
    run_tool_program,
)
from atgrpo.envs.math import MathConfig, MathEnv
from atgrpo.envs.tool import NO_CODE, PROGRAM_PATH
from atgrpo.sandbox import Backend, SandboxLimits, probe
from atgrpo.sandbox import run as sandbox_run
from atgrpo.splits import Split, split_of
from conftest import FakeSandbox

FAST = SandboxLimits(wall_time_s=3.0, cpu_time_s=3)
CRASH = "```python\nimport os\nclass A: pass\nprint(os.getcwd(), __file__, A())\n1 / 0\n```"

pytestmark = pytest.mark.filterwarnings("ignore::atgrpo.sandbox.SandboxWarning")


def test_the_program_is_taken_from_the_last_code_block_and_run() -> None:
    run = run_tool_program(
        "First\n```python\nprint(1)\n```\nthen\n```python\nprint(6 * 7)\n```", FAST
    )
    assert run == ProgramRun("print(6 * 7)", "ok", "42\n", "", "", False)
    assert run.ok and run.has_code
    none = run_tool_program("no code here", FAST)
    assert none.status == NO_CODE and not none.ok and not none.has_code
    assert none.describe() == "The helper wrote no program."


def test_a_crash_is_a_status_with_a_deterministic_traceback() -> None:
    first, second = run_tool_program(CRASH, FAST), run_tool_program(CRASH, FAST)
    assert first == second  # the same texts in two runs
    assert first.status == "error" and first.error == "ZeroDivisionError: division by zero"
    assert f'File "{PROGRAM_PATH}", line 4' in first.stderr
    assert first.stdout == f"/sandbox {PROGRAM_PATH} <__main__.A object at 0x0>\n"
    assert first.describe().endswith("It failed (error): ZeroDivisionError: division by zero")


@pytest.mark.skipif(os.geteuid() != 0, reason="the launcher's fallback is simulated from root")
def test_the_fallback_mode_s_temporary_paths_read_as_the_sandbox_s() -> None:
    with pytest.warns(sandbox.SandboxWarning):
        plain = probe._build_launcher.__wrapped__(False, Backend.UNSHARE)  # a non-root user's
    with mock.patch.object(sandbox_run, "get_launcher", lambda: plain):
        raw = sandbox.run_python("import os\nprint(__file__)\n1 / 0\n", FAST)
        runs = [run_tool_program(CRASH, FAST) for _ in range(2)]
    assert "atgrpo-sandbox-" in raw.stdout and "atgrpo-sandbox-" in raw.stderr  # what it hides
    assert runs[0] == runs[1]
    assert runs[0].stdout.split()[:2] == ["/sandbox", PROGRAM_PATH]
    assert f'File "{PROGRAM_PATH}", line 4' in runs[0].stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('  File "/tmp/atgrpo-sandbox-ab_12cd3/tmpq9x_2k1a/prog.py", line 3', "/sandbox/prog.py"),
        ("cwd: /var/tmp/atgrpo-sandbox-abc/tmpzzz", "cwd: /sandbox"),
        ("in /dev/shm/atgrpo-sandbox-k2/tmpk3.", "in /sandbox."),
        ("python: can't open file '/home/u/tmp/prog.py'", "'/sandbox/prog.py'"),
        ("<__main__.A object at 0x7f3a2b1c0d90>", "<__main__.A object at 0x0>"),
        ("0x7f3a2b is a number, prog.pyc stays", "0x7f3a2b is a number, prog.pyc stays"),
    ],
)
def test_normalise_program_text(text: str, expected: str) -> None:
    assert expected in normalise_program_text(text)


def test_a_temp_dir_with_a_space_is_normalised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", "/data/my tmp")
    text = "at /data/my tmp/atgrpo-sandbox-abc/tmpzzz/prog.py, line 1"
    assert normalise_program_text(text) == f"at {PROGRAM_PATH}, line 1"


def test_a_long_output_is_normalised_in_linear_time() -> None:
    import time

    text = "/a" * 30_000 + " " + "/x/" * 20_000
    start = time.perf_counter()
    assert normalise_program_text(text) == text
    assert time.perf_counter() - start < 2.0


def test_the_env_s_packages_are_what_a_program_may_import() -> None:
    program = "```python\nimport yaml\nprint(yaml.safe_dump([1]), end='')\n```"
    default = run_tool_program(program, SandboxSettings().sandbox_limits)
    assert default.error == "ModuleNotFoundError: No module named 'yaml'"
    settings = SandboxSettings(sandbox_packages=["PyYAML"], sandbox_wall_time_s=2.5)
    limits = settings.sandbox_limits
    assert (limits.wall_time_s, limits.cpu_time_s, limits.packages) == (2.5, 3, ("PyYAML",))
    assert run_tool_program(program, limits).stdout == "- 1\n"
    with pytest.raises(ValidationError, match="sandbox_packages"):
        SandboxSettings(sandbox_packages=["no-such-package-atgrpo"])


def test_a_family_runs_its_tool_through_the_helper_with_its_limits() -> None:
    env = MathEnv(MathConfig(sandbox_wall_time_s=1.5, sandbox_packages=["numpy"]))
    env.reset(seed=0)
    fake = FakeSandbox("5\n", sandbox.ExitStatus.ERROR)
    fake_limits: list[Any] = []

    def recording(code: str, limits: SandboxLimits | None = None) -> sandbox.SandboxResult:
        fake_limits.append(limits)
        return fake(code, limits)

    with mock.patch.object(sandbox, "run_python", recording):
        outcome = env.step("```python\nprint(5)\n```")
    assert fake.calls == ["print(5)"] and outcome.info["program_status"] == "error"
    assert fake_limits[0].wall_time_s == 1.5 and fake_limits[0].packages == ("numpy",)


def test_run_program_takes_code_already_extracted() -> None:
    run = run_program("print('hi')", FAST)
    assert run.ok and run.stdout == "hi\n" and run.code == "print('hi')"


# -- the worked example of docs/custom-env.md ("Running model-written code") -------------------


class SumConfig(SandboxSettings):  # the sandbox_* fields, validated like any setting
    size: int = Field(default=5, ge=2, description="Numbers per task.")


class SumEnv(TurnBasedEnv[tuple[int, ...]]):
    """A tool agent writes a program that sums the numbers; a reporter gives the total.

    team = 1 when the reporter's number is the sum, else 0 (the tool defers it); tool local =
    1 when its program prints the sum, 0 when it prints another number, -0.5 without one;
    reporter local = its team reward."""

    config_class: ClassVar[type[SumConfig]] = SumConfig

    def __init__(self, config: SumConfig | None = None) -> None:
        self.config = config or SumConfig()
        super().__init__(Workflow("sum", ("tool", "reporter"), 1, defers_team=("tool",)))
        self._run: ProgramRun | None = None
        self._correct = False

    def _draw_instance(self, seed: int, split: Split) -> tuple[int, ...]:
        rng = random.Random(seed)
        while True:
            numbers = tuple(rng.randint(1, 99) for _ in range(self.config.size))
            if split_of(f"sum:{numbers}") is split:
                return numbers

    def _begin(self, instance: tuple[int, ...]) -> None:
        self._run, self._correct = None, False

    @property
    def instance_key(self) -> str:
        return f"sum:{self._current_instance}"

    def _prompt(self, agent_id: str) -> list[Message]:
        task = f"Numbers: {list(self._current_instance)}"
        if agent_id == "tool":
            ask = "Write a Python program that prints their sum, in a ```python block."
        else:  # the program and what it printed (or its error), the same in every run
            ask = (self._run.describe() if self._run else "") + "\nGive the sum."
        return [{"role": "user", "content": f"{task}\n{ask}"}]

    def _act(self, agent_id: str, text: str) -> tuple[StepOutcome, bool]:
        total = sum(self._current_instance)
        if agent_id == "tool":
            self._run = run_tool_program(text, self.config.sandbox_limits)  # never raises
            printed = self._run.stdout.split()[-1:] if self._run.ok else []
            local = -0.5 if not printed else float(printed[0] == str(total))
            info = {"status": self._run.status, "error": self._run.error}
            return StepOutcome(0.0, local, bool(printed), info), False
        self._correct = text.strip().split()[-1:] == [str(total)]
        team = float(self._correct)
        return StepOutcome(team, team, bool(text.strip()), {}), self._correct

    @property
    def success(self) -> bool:
        return self._correct


def test_the_worked_tool_agent_example_scores_and_passes_check_env() -> None:
    env = SumEnv()
    env.reset(seed=0)
    total = sum(env._current_instance)
    program = f"```python\nprint(sum({list(env._current_instance)}))\n```"
    assert env.step(program).local_reward == 1.0
    assert f"It printed:\n{total}" in env.observe("reporter")[0]["content"]
    assert env.step(f"The sum is {total}").team_reward == 1.0 and env.success
    check_env(SumEnv(), factory=SumEnv)
