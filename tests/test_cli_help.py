"""Every argument of every ``atgrpo`` command is described in its ``--help`` (issue 25)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from atgrpo.cli import build_parser, main


def commands(
    parser: argparse.ArgumentParser, name: str = "atgrpo"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the command line, subcommands (and theirs) included, by its name."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from commands(subparser, f"{name} {sub}")


def test_every_argument_of_every_command_has_a_help() -> None:
    names = []
    for name, parser in commands(build_parser()):
        names.append(name)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                assert all(a.help for a in action._choices_actions), f"{name}: a subcommand"
                continue
            what = "/".join(action.option_strings) or action.dest
            assert action.help and action.help.strip(), f"{name} {what} has no help"
    for command in ("train", "eval", "compare", "config", "report", "check-env", "models"):
        assert f"atgrpo {command}" in names


@pytest.mark.parametrize("command", ["eval", "check-env"])
def test_help_prints_every_argument_described(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "overrides" in out and "dotted key=value overrides" in out


def test_docs_cli_names_every_command_and_option() -> None:
    from conftest import REPO

    page = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    for name, parser in commands(build_parser()):
        if name == "atgrpo" or name == "atgrpo models":
            continue
        assert f"## {name}" in page, name
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert f"`{option}" in page, f"{name} {option}"
