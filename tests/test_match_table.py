"""The win-rate table of a game comparison, from the files `atgrpo eval --opponent` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atgrpo.experiments.match_table import Tally, orderings, own_seats, table


def _seat(
    policy: str, seat: str, wins: int, games: int = 10, invalid: int = 0, draws: int = 0
) -> dict:
    return {
        "policy": policy,
        "seat": seat,
        "games": games,
        "wins": wins,
        "draws": draws,
        "losses": games - wins - draws,
        "invalid_moves": invalid,
        "moves": 2 * games,
    }


def _write(folder: Path, opponent: str, seats: list[dict], routing: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"schema": 1, "opponent": opponent, "seats": seats, "config": {"routing": routing}}
    (folder / f"eval-test-vs-{opponent}.json").write_text(json.dumps(record))


def test_a_per_role_policy_counts_in_its_own_seat_and_a_shared_one_in_every_seat() -> None:
    per_role = {
        "seats": [
            _seat("first", "player_0", 7),
            _seat("first", "player_1", 1),  # not its seat in training: left out
            _seat("second", "player_0", 2),  # nor this
            _seat("second", "player_1", 5, invalid=4),
        ],
        "config": {"routing": {"player_0": "first", "player_1": "second"}},
    }
    assert own_seats(per_role) == Tally(wins=12, games=20, invalid=4, moves=40)
    shared = {"seats": [_seat("shared", "player_0", 7), _seat("shared", "player_1", 1)]}
    assert own_seats(shared | {"config": {}}) == Tally(wins=8, games=20, invalid=0, moves=40)


def test_the_table_pools_the_seeds_and_shows_each_and_the_untrained_model(tmp_path: Path) -> None:
    shared = [_seat("shared", "player_0", 5), _seat("shared", "player_1", 3)]
    _write(tmp_path / "untrained", "random", shared, {})
    method = tmp_path / "runs" / "kuhn" / "at-grpo"
    _write(
        method / "seed0/checkpoints/step-000024", "random", [_seat("shared", "player_0", 10)], {}
    )
    _write(method / "seed1/checkpoints/step-000024", "random", [_seat("shared", "player_0", 5)], {})
    (method / "seed2").mkdir()  # not evaluated yet
    (method / "seed0.log").write_text("the comparison's log of seed 0")  # not a seed
    rows = table(tmp_path, ["random", "rule"]).splitlines()
    assert len(rows) == 4  # the header, its rule, one row per opponent
    random_row = rows[2].split(" | ")
    assert random_row[2] == "40.0 % [21.9, 61.3] of 20, invalid 0 %"  # before: 8 of 20
    assert random_row[3] == "seed0 100 %, seed1 50 %, seed2 -"
    # after: 15 of 20, seeds pooled; the seeds (10 of 10 and 5 of 10) resampled, then their
    # games: seed1 drawn twice reaches below its own 50 % (Wilson over the 20 games: [53.1, 88.8])
    assert random_row[4].startswith("75.0 % [35.0, 100.0] of 20")
    assert rows[3].endswith("| - | seed0 -, seed1 -, seed2 - | - |")  # no rule evaluations


def test_the_orderings_set_each_row_against_the_untrained_model_and_the_others(
    tmp_path: Path,
) -> None:
    _write(tmp_path / "untrained", "random", [_seat("shared", "player_0", 20, games=100)], {})
    rows = {"strong": [70, 72, 68], "weak": [22, 20, 21], "lucky": [90, 20, 21]}
    for name, wins in rows.items():
        for seed, won in enumerate(wins):
            folder = tmp_path / "runs" / "kuhn" / name / f"seed{seed}" / "checkpoints/step-000024"
            _write(folder, "random", [_seat("shared", "player_0", won, games=100)], {})
    lines = orderings(tmp_path, ["random"]).splitlines()
    cells = [line.strip("| ").split(" | ") for line in lines[2:]]  # under the header
    got = {(c[1], c[2]): (c[3], c[5]) for c in cells}
    assert len(lines) == 2 + 3 + 3 and len(got) == 6  # each row minus untrained; each pair once
    assert got[("strong", "untrained")][1] == "above 0"
    assert got[("strong", "untrained")][0].startswith("+50.0 [")
    assert got[("weak", "untrained")][1] == "overlaps 0"
    assert got[("lucky", "strong")][1] == "overlaps 0"  # one seed of three: not an ordering
    assert got[("strong", "weak")][1] == "above 0"
    assert orderings(tmp_path, ["rule"]).count("\n") == 1  # no rule evaluations: no rows


def test_draws_show_beside_the_wins_and_count_with_them_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from atgrpo.experiments.match_table import NOT_LOST, main

    # Against a player that is never beaten: every win rate is 0, the draws are what moved.
    _write(tmp_path / "untrained", "rule", [_seat("shared", "player_0", 0, games=50)], {})
    for seed, drawn in enumerate([20, 25, 15]):
        folder = tmp_path / "runs" / "ttt" / "at-grpo" / f"seed{seed}" / "checkpoints/step-16"
        _write(folder, "rule", [_seat("shared", "player_0", 0, games=50, draws=drawn)], {})
    won = table(tmp_path, ["rule"]).splitlines()[2].split(" | ")
    assert won[2] == "0.0 % [0.0, 7.1] of 50, invalid 0 %"  # no draws: none shown
    assert won[3] == "seed0 0 %, seed1 0 %, seed2 0 %"
    assert won[4].startswith("0.0 % [0.0, 2.5] of 150, drawn 40 %")  # Wilson: 0 of 150
    assert "overlaps 0" in orderings(tmp_path, ["rule"])  # 0 won against 0 won
    not_lost = table(tmp_path, ["rule"], score=NOT_LOST).splitlines()[2].split(" | ")
    assert not_lost[3] == "seed0 40 %, seed1 50 %, seed2 30 %"
    assert not_lost[4].startswith("40.0 % [")
    ordered = orderings(tmp_path, ["rule"], score=NOT_LOST)
    assert "| rule | at-grpo | untrained | +40.0 [" in ordered and "above 0" in ordered
    assert main([str(tmp_path), "rule"]) == 0  # the won tables, then the not-lost ones
    won_part, not_lost_part = capsys.readouterr().out.split("Games not lost (won or drawn):")
    assert "above 0" not in won_part and "above 0" in not_lost_part
    _write(tmp_path / "untrained", "random", [_seat("shared", "player_0", 5)], {})
    assert main([str(tmp_path), "random"]) == 0  # no draws there: no second part
    assert "not lost" not in capsys.readouterr().out


def test_training_moves_count_each_quarter_of_the_steps_with_the_primed_prefix(
    tmp_path: Path,
) -> None:
    from atgrpo.experiments.match_table import main, moves_table, training_moves

    def row(step: int, response: str, valid: bool = True, invalid_move: bool = False) -> str:
        info = {"invalid_move": invalid_move}
        return json.dumps({"step": step, "response": response, "valid": valid, "info": info})

    run = tmp_path / "runs" / "kuhn" / "at-grpo" / "seed0"
    run.mkdir(parents=True)
    rows = [
        row(1, "check] and I wait"),  # the prefix's "[" opens the move
        row(2, "Check] again"),  # counted in lower case
        row(3, "bet]", invalid_move=True),  # the game refused it
        row(5, "fold]"),
        row(8, "nonsense", valid=False),
    ]
    (run / "samples.jsonl").write_text("\n".join(rows) + "\n")
    got = training_moves(run, "My move is [", steps=8)
    assert got == [{"check": 2}, {"invalid": 1}, {"fold": 1}, {"invalid": 1}]
    (run / "config.yaml").write_text("env: {answer_prefix: 'My move is ['}\ntrain: {steps: 8}\n")
    table_rows = moves_table(tmp_path).splitlines()
    assert table_rows[2] == "| at-grpo | seed0 | check 2 | invalid 1 | fold 1 | invalid 1 | - |"
    steps = [{"step": 1, "loss/skipped": True}, {"step": 2, "loss/skipped": False}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in steps) + "\n")
    assert moves_table(tmp_path).splitlines()[2].endswith("| invalid 1 | 1 of 2 |")
    per_role = [{"step": 1, "loss/first/skipped": True, "loss/second/skipped": True}]
    (run / "metrics.jsonl").write_text(json.dumps(per_role[0]) + "\n")
    assert moves_table(tmp_path).splitlines()[2].endswith("| first 1 of 1, second 1 of 1 |")
    assert main([str(tmp_path), "--moves"]) == 0
    assert main(["--moves"]) == 2
