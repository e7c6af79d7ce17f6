"""Every short `atgrpo` command of the README runs as written, on the tiny model.

The commands are read from the README's bash blocks. Each runs in-process through
``atgrpo.cli.main`` with the tiny random model and a one-step budget appended as overrides, and
``runs/`` pointed at a temporary folder; commands that need the real model, a trained demo
run, a Ray cluster or hours (``compare --train``) are listed in ``LONG`` and left out.
"""

from __future__ import annotations

import glob
import re
import shlex
from pathlib import Path

import pytest

from atgrpo.cli import main
from conftest import REPO

LONG = ("--train", "backend.", "configs/gpu/", "models prepare", "report runs/demo-")
TINY = [
    "model.path=tiny-random-llama",
    "train.steps=1",
    "rollout.max_new_tokens=4",
    "rollout.max_prompt_tokens=4096",
    "eval.num_tasks=1",
    "eval.max_new_tokens=4",
    "eval.before_training=false",
    "eval.after_training=false",
]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(".venv/bin/atgrpo ")]


def test_the_readme_has_commands_to_check() -> None:
    commands = readme_commands()
    assert len(commands) >= 10
    assert any(c.startswith(".venv/bin/atgrpo eval ") and "routing." in c for c in commands)


def _tiny(config: str) -> list[str]:
    """The one-step tiny budget, and the tiny model for each role of a per-role config."""
    roles = ["policies.tool.model=tiny-random-llama", "policies.planner.model=tiny-random-llama"]
    return [*TINY, *(roles if "per_role" in config else [])]


def _train_one_step(config: str, names: list[str], runs: Path) -> None:
    for name in names:
        setup = ["train", config, *_tiny(config), f"run.output_dir={runs}", f"run.name={name}"]
        assert main(setup) == 0


def _argv(command: str, runs: Path) -> list[str]:
    argv = shlex.split(command)[1:]
    argv = [a.replace("runs/", f"{runs}/") if a.startswith("runs/") else a for a in argv]
    argv = [p for a in argv for p in (sorted(glob.glob(a)) if "*" in a else [a])]  # the shell's
    if "--out" in argv:  # never write into the repository
        i = argv.index("--out") + 1
        argv[i] = str(runs / argv[i])
    if argv[0] in ("train", "eval"):
        argv += [*_tiny(argv[1]), f"run.output_dir={runs}"]
    return argv


@pytest.mark.parametrize("command", [c for c in readme_commands() if not any(x in c for x in LONG)])
def test_a_readme_command_runs(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    runs = tmp_path / "runs"
    if " tool-use " in command:  # an evaluation's samples: train one step, evaluate it
        _train_one_step("configs/demo.yaml", ["my-run"], runs)
        tiny = [*_tiny("configs/demo.yaml"), f"run.output_dir={runs}"]
        assert main(["eval", "configs/demo.yaml", "--checkpoint", f"{runs}/my-run", *tiny]) == 0
    elif "--checkpoint" in command:  # a trained run to evaluate: train it for one step first
        _train_one_step(command.split()[2], re.findall(r"runs/([\w.-]+)", command), runs)
    elif "--resume" in command:  # a run to continue (resuming none is an error): train it first
        name = re.search(r"run\.name=([\w.-]+)", command)
        assert name, command
        _train_one_step(command.split()[2], [name.group(1)], runs)
    elif command.split()[1] in ("report", "groups", "slim"):  # runs to read: train them first
        _train_one_step("configs/tiny.yaml", re.findall(r"runs/([\w.-]+)", command), runs)
    assert main(_argv(command, runs)) == 0, command
