"""Every short `atgrpo` command of the README runs as written, on the tiny model.

The commands are read from the README's bash blocks. Each runs in-process through
``atgrpo.cli.main`` with the tiny random model and a one-step budget appended as overrides, and
``runs/`` pointed at a temporary folder; commands that need the real model, a trained demo
run, a Ray cluster or hours (``compare --train``) are listed in ``LONG`` and left out.

The README and docs/ hold together: the two front pages stay short, no page names an issue
number, and every relative link resolves to a file and, into a Markdown page, to a heading.
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


# -- the docs hold together: short front pages, no issue numbers, every relative link resolves ---

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
ISSUE_NUMBER = re.compile(r"issue[- ]?#?[0-9]+", flags=re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans removed."""
    lines, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((n, re.sub(r"`[^`]*`", "", line)))
    return lines


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercase, punctuation dropped, spaces to '-',
    a repeated one suffixed -1, -2, ..."""
    anchors: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} (.*)", line)
        if fenced or not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).strip().lower()
        slug = "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")
        anchor, k = slug, 0
        while anchor in anchors:
            k += 1
            anchor = f"{slug}-{k}"
        anchors.add(anchor)
    return anchors


def test_the_front_pages_stay_short() -> None:
    """The README is the two commands, the demo and a tour; results.md the summary of results."""
    readme = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    summary = (REPO / "docs/results.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) < 300, f"README.md has {len(readme)} lines: move detail into docs/"
    assert len(summary) < 150, f"docs/results.md has {len(summary)} lines: tables in docs/results/"


def test_the_user_docs_name_no_issue_numbers() -> None:
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in DOCS
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if ISSUE_NUMBER.search(line)
    ]
    assert not found, "say what the issue was about instead:\n" + "\n".join(found)


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for path in DOCS:
        for n, line in _prose(path):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                where = f"{path.relative_to(REPO)}:{n}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)
