"""atgrpo tool-use: the turns of a tool team, paired from an evaluation's samples file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from atgrpo.experiments.tool_use import tool_use
from conftest import REPO

FAST = ["rollout.max_prompt_tokens=2048", "rollout.max_new_tokens=8"]


def _turn(task: int, tool: str | None, planner: str | None, goal: str) -> list[dict[str, Any]]:
    """One turn: the tool's moves and the planner's (None: invalid); ``goal`` is the right plan."""

    def sample(agent: str, moves: str | None) -> dict[str, Any]:
        info = {"moves": moves, "plan_reaches_goal": moves == goal}
        where = {"task_id": task, "branch_idx": 0, "turn_idx": 0, "agent_id": agent}
        return where | {"valid": moves is not None, "info": info, "response": f'print("{moves}")'}

    return [sample("tool", tool), sample("planner", planner)]


def test_rates_split_by_whether_the_tool_was_right() -> None:
    records = [
        *_turn(0, "DR", "DR", goal="DR"),  # tool right, followed
        *_turn(1, "DR", "RD", goal="RD"),  # tool wrong, planner right on its own
        *_turn(2, "DR", "DR", goal="LL"),  # tool wrong, followed
        *_turn(3, None, "UU", goal="UU"),  # tool invalid
    ]
    s = tool_use(records).summary()
    assert s["turns"] == 4
    assert s["tool_valid"] == 0.75 and s["tool_right"] == 0.25 and s["actor_right"] == 0.75
    assert s["actor_is_tool"] == pytest.approx(2 / 3)  # of the three valid tool answers
    assert s["actor_right_when_tool_right"] == 1.0 and s["actor_is_tool_when_tool_right"] == 1.0
    assert s["actor_right_when_tool_wrong"] == 0.5 and s["actor_is_tool_when_tool_wrong"] == 0.5
    assert s["tool_answers"] == [("DR", 3)]
    assert s["tool_programs"] == [('print("DR")', 3)]


def test_sokoban_samples_are_read_by_their_moves_and_solved() -> None:
    records = _turn(0, "LU", "LU", goal="LU") + _turn(1, None, "R", goal="U")
    for r in records:
        r["instance_key"] = "sokoban:######/#P.T.#"
        r["info"] = {"moves": r["info"]["moves"], "solved": r["info"]["plan_reaches_goal"]}
    s = tool_use(records).summary()
    assert s["tool_valid"] == 0.5 and s["tool_right"] == 0.5 and s["actor_right"] == 0.5
    assert s["actor_is_tool_when_tool_right"] == 1.0


def test_unknown_agents_and_keys_are_one_line_errors() -> None:
    records = _turn(0, "DR", "DR", goal="DR")
    with pytest.raises(ValueError, match="no samples of agent 'coder'"):
        tool_use(records, tool="coder")
    for r in records:
        r["info"] = {"x": 1}
    with pytest.raises(ValueError, match="--keys ANSWER,RIGHT"):
        tool_use(records)


def test_eval_writes_every_episode_and_tool_use_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from atgrpo.cli import main

    tiny = str(REPO / "configs" / "tiny.yaml")
    args = [tiny, f"run.output_dir={tmp_path}", "run.name=base", *FAST, "--num-tasks", "3"]
    assert main(["eval", *args]) == 0
    path = tmp_path / "base" / "eval-test-samples.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["task_id"] for r in records} == {0, 1, 2}
    assert {r["agent_id"] for r in records} == {"tool", "planner"}
    assert all(r["step"] == 0 and r["instance_key"].startswith("plan_path:") for r in records)
    capsys.readouterr()
    assert main(["tool-use", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["turns"] == len(records) // 2  # each turn: one tool and one planner sample
    assert main(["tool-use", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run atgrpo eval first" in err
