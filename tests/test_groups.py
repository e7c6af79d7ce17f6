"""atgrpo groups: a run's advantage groups per agent and turn, averaged over its steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atgrpo.cli import main
from atgrpo.experiments.groups import format_costs, format_groups, group_rows, step_costs


def _step(step: int, **groups: tuple[float, float, float]) -> dict:
    """A metrics record; each keyword ``reasoner_t1=(count, size, tied)`` one (agent, turn)."""
    record: dict = {"step": step, "loss/loss": 0.1}
    for name, (count, size, tied) in groups.items():
        agent, turn = name.rsplit("_t", 1)
        prefix = f"groups/{agent}/t{turn}/"
        record |= {prefix + "count": count, prefix + "mean_size": size}
        record |= {prefix + "zero_std_frac": tied, prefix + "valid": 1.0}
    return record


RECORDS = [
    _step(1, tool_t0=(4, 4, 0.5), reasoner_t0=(4, 4, 0.25)),
    _step(2, tool_t0=(4, 4, 0.0), reasoner_t0=(4, 4, 0.75), tool_t1=(2, 1, 1.0)),
    _step(3, tool_t0=(2, 4, 1.0), reasoner_t0=(2, 4, 1.0)),
]


def test_means_over_the_steps_that_logged_each_agent_and_turn() -> None:
    rows = group_rows(RECORDS)
    assert [(r.agent, r.turn, r.steps) for r in rows] == [
        ("tool", 0, 3),
        ("reasoner", 0, 3),  # order of first appearance within a turn
        ("tool", 1, 1),  # the second turn happened on one step only
    ]
    assert rows[0].means["count"] == pytest.approx(10 / 3)
    assert rows[0].means["zero_std_frac"] == pytest.approx(0.5)
    assert rows[1].means["zero_std_frac"] == pytest.approx(2 / 3)
    assert rows[2].means == {"count": 2, "mean_size": 1, "zero_std_frac": 1.0, "valid": 1.0}
    assert "response_tokens" not in rows[0].means  # not logged: not made up


def test_a_step_range_keeps_only_its_steps() -> None:
    rows = group_rows(RECORDS, first=2, last=None)
    assert [r.steps for r in rows] == [2, 2, 1]
    assert rows[0].means["count"] == 3.0
    assert group_rows(RECORDS, first=4) == []


def test_the_table_has_a_line_per_agent_and_turn() -> None:
    table = format_groups(group_rows(RECORDS)).splitlines()
    assert len(table) == 4 and table[0].split()[:3] == ["agent", "turn", "steps"]
    assert table[3].split()[:6] == ["tool", "1", "1", "2.0", "1.0", "100.0"]


def _costs(step: int, tokens_per_s: float, rollout_s: float, samples: float) -> dict:
    return {
        "step": step,
        "perf/rollout_tokens_per_s": tokens_per_s,
        "perf/rollout_s": rollout_s,
        "perf/step_s": rollout_s + 1.0,
        "rollout/samples": samples,
    }


def test_step_costs_are_medians_of_each_step_s_last_record() -> None:
    records = [
        _costs(1, 10.0, 10.0, 32),  # 100 tokens
        _costs(2, 50.0, 2.0, 32),  # redone after a resume: its last record counts
        _costs(2, 20.0, 10.0, 40),  # 200 tokens
        _costs(3, 30.0, 10.0, 48),  # 300 tokens
        {"step": 4, "loss/loss": 0.0},  # logged nothing of cost
    ]
    costs = step_costs(records)
    assert costs == {
        "sampled_tokens": 200.0,
        "samples": 40.0,
        "rollout_s": 10.0,
        "step_s": 11.0,
    }  # no update_s logged: left out, not 0
    assert step_costs(records, first=3)["sampled_tokens"] == 300.0
    assert step_costs(records, first=5) == {}
    line = format_costs(costs)
    assert line == "median step: 200 tokens sampled, 40 samples, rollout 10.0 s, step 11.0 s"
    assert format_costs({}) == ""


def test_cli_reads_a_run_folder(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert main(["groups", str(run), "--steps", "1:2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [g["steps"] for g in out["groups"]] == [2, 2, 1]
    assert out["step"] == {}  # these records log no costs


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing"], "no metrics.jsonl"),
        (["RUN", "--steps", "5"], "FIRST:LAST"),
        (["RUN", "--steps", "9:"], "no groups/ metrics"),
    ],
)
def test_cli_errors_are_one_line(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps(RECORDS[0]) + "\n")
    args = [
        str(tmp_path) if a == "RUN" else str(tmp_path / a) if a == "missing" else a for a in args
    ]
    assert main(["groups", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
