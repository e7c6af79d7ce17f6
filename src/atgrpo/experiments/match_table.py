"""The win-rate table of a game comparison: each row's trained players against fixed opponents
before training (the untrained model) and after (each seed's run).

It reads the ``eval-<split>-vs-<opponent>.json`` files that ``atgrpo eval --opponent`` writes
(:mod:`atgrpo.experiments.matches`): ``<root>/untrained/`` for the model before training and
``<root>/runs/<benchmark>/<method>/seed<n>/checkpoints/step-<N>/`` for the comparison's runs (``make
compare-textarena`` writes both). A policy counts in the seats the run's routing gave it (a
shared policy: every seat; a per-role policy: its own), so each row is its trained players'
games. The seeds' own win rates stand beside the pooled one, whose 95 % interval resamples the
seeds and then each one's games (:func:`~atgrpo.experiments.intervals.counts_interval`; Wilson's
over games for one seed), so a run that went its own way widens it. Below the table, the
orderings: each row against the untrained model and against every other row, the difference in
win rate with its interval (both sides resampled the same way, unpaired), and whether it lies
clear of 0::

    python -m atgrpo.experiments.match_table runs/compare-textarena-kuhn random rule

A game with draws shows each cell's drawn games beside its won ones, and below come the same
two tables with a draw counted as a game not lost (won or drawn): against an opponent that is
rarely beaten, such as Tic-Tac-Toe's rule-based player, every win rate is 0 and what training
can move is how often a game ends drawn rather than lost.

``--moves`` prints instead what each run played in training, from its ``samples.jsonl``: the
bracketed moves of every sampled answer (the primed ``env.answer_prefix`` in front), counted by
quarter of the run's steps, invalid moves apart. A run whose samples are one move throughout has
collapsed onto it (self-play that only checks never meets a bet, so never learns to answer one).
"""

from __future__ import annotations

import collections
import itertools
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from atgrpo.experiments.intervals import Interval, counts_difference, counts_interval

_MOVE = re.compile(r"\[([^\[\]]*)\]")  # TextArena's bracketed move: the first one counts


WON, NOT_LOST = "won", "not lost"  # what a rate counts: the wins, or the wins and the draws


@dataclass(frozen=True)
class Tally:
    """A side's games against one opponent: wins and draws among games, invalid among its
    moves."""

    wins: int = 0
    games: int = 0
    invalid: int = 0
    moves: int = 0
    draws: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            wins=self.wins + other.wins,
            games=self.games + other.games,
            invalid=self.invalid + other.invalid,
            moves=self.moves + other.moves,
            draws=self.draws + other.draws,
        )

    def counted(self, score: str) -> int:
        """The games ``score`` counts: won (:data:`WON`), or won or drawn (:data:`NOT_LOST`)."""
        return self.wins + self.draws if score == NOT_LOST else self.wins


def _text(seeds: list[Tally], score: str) -> str:
    """The seeds' games pooled: the rate with its interval, the games, the draws where the game
    has any, the invalid moves."""
    total = sum(seeds, Tally())
    rate = counts_interval(*_counts(seeds, score))
    invalid = total.invalid / total.moves if total.moves else 0.0
    drawn = f", drawn {100 * total.draws / total.games:.0f} %" if total.draws else ""
    return (
        f"{100 * rate.mean:.1f} % [{100 * rate.low:.1f}, {100 * rate.high:.1f}] of "
        f"{total.games}{drawn}, invalid {100 * invalid:.0f} %"
    )


def own_seats(record: dict[str, Any]) -> Tally:
    """The games of each policy in the seats its run's routing gave it (every seat of a policy
    that plays them all)."""
    routing: dict[str, str] = record["config"].get("routing") or {}
    total = Tally()
    for seat in record["seats"]:
        if routing and routing.get(seat["seat"]) != seat["policy"]:
            continue
        total += Tally(
            wins=seat["wins"],
            games=seat["games"],
            invalid=seat["invalid_moves"],
            moves=seat["moves"],
            draws=seat["draws"],
        )
    return total


def _tally(folder: Path, opponent: str, split: str) -> Tally | None:
    """The record in ``folder`` (the untrained model's) or beside its run's latest checkpoint."""
    name = f"eval-{split}-vs-{opponent}.json"
    found = [folder / name] if (folder / name).is_file() else []
    found += sorted(folder.glob(f"checkpoints/step-*/{name}"))
    if not found:
        return None
    return own_seats(json.loads(found[-1].read_text(encoding="utf-8")))


def _methods(root: Path) -> list[tuple[Path, list[Path]]]:
    """Each method folder of a comparison under ``root/runs/<benchmark>/`` with its seed runs
    (the ``seed<n>`` folders, not the comparison's ``seed<n>.log`` or ``.claim`` beside them)."""
    methods = sorted(p for p in (root / "runs").glob("*/*") if p.is_dir())
    return [(m, sorted(p for p in m.glob("seed*") if p.is_dir())) for m in methods]


def table(root: Path, opponents: list[str], split: str = "test", score: str = WON) -> str:
    """The Markdown table: a row per trained method and opponent, before and after training;
    the rates count the games ``score`` names (:meth:`Tally.counted`)."""
    lines = [
        "| method | opponent | before training | after, per seed | after, seeds pooled |",
        "|---|---|---|---|---|",
    ]
    for method, seeds in _methods(root):
        for opponent in opponents:
            before = _tally(root / "untrained", opponent, split)
            after = {s.name: _tally(s, opponent, split) for s in seeds}
            done = [t for t in after.values() if t is not None]
            per_seed = ", ".join(
                f"{name} {100 * t.counted(score) / t.games:.0f} %" if t and t.games else f"{name} -"
                for name, t in after.items()
            )
            lines.append(
                f"| {method.name} | {opponent} | {_text([before], score) if before else '-'} "
                f"| {per_seed} | {_text(done, score) if done else '-'} |"
            )
    return "\n".join(lines)


def orderings(root: Path, opponents: list[str], split: str = "test", score: str = WON) -> str:
    """Each trained row minus the untrained model, and minus every other row, per opponent:
    the difference in the rate of games ``score`` counts (points) with its 95 % interval
    (module docstring) and where it lies: ``above`` or ``below`` 0, or ``overlaps`` 0."""
    lines = [
        "| opponent | row | minus | difference, points [95 %] | seeds | interval |",
        "|---|---|---|---|---|---|",
    ]
    for opponent in opponents:
        cells = {"untrained": [t for t in [_tally(root / "untrained", opponent, split)] if t]}
        for method, seeds in _methods(root):
            cells[method.name] = [t for s in seeds if (t := _tally(s, opponent, split))]
        trained = [name for name in cells if name != "untrained"]
        pairs = [(a, "untrained") for a in trained] + list(itertools.combinations(trained, 2))
        for a, b in pairs:
            if not cells[a] or not cells[b]:
                continue
            diff = counts_difference(_counts(cells[a], score), _counts(cells[b], score))
            runs = f"{len(cells[a])} and {len(cells[b])}"
            lines.append(f"| {opponent} | {a} | {b} | {_points(diff)} | {runs} | {_where(diff)} |")
    return "\n".join(lines)


def _counts(seeds: list[Tally], score: str) -> tuple[list[int], list[int]]:
    return [t.counted(score) for t in seeds], [t.games for t in seeds]


def _points(diff: Interval) -> str:
    return f"{100 * diff.mean:+.1f} [{100 * diff.low:+.1f}, {100 * diff.high:+.1f}]"


def _where(diff: Interval) -> str:
    return "above 0" if diff.low > 0 else "below 0" if diff.high < 0 else "overlaps 0"


def training_moves(run: Path, prefix: str, steps: int, parts: int = 4) -> list[dict[str, int]]:
    """The moves a run sampled in training, counted per ``parts`` equal spans of its ``steps``:
    the first bracketed move of ``prefix`` + the answer, ``invalid`` where the game refused it."""
    spans: list[collections.Counter[str]] = [collections.Counter() for _ in range(parts)]
    with (run / "samples.jsonl").open(encoding="utf-8") as rows:
        for line in rows:
            row = json.loads(line)
            span = min(parts - 1, (row["step"] - 1) * parts // steps)
            found = _MOVE.search(prefix + row["response"])
            invalid = not row["valid"] or (row.get("info") or {}).get("invalid_move")
            move = "invalid" if invalid or found is None else found.group(1).strip().lower()
            spans[span][move] += 1
    return [dict(c.most_common()) for c in spans]


def skipped_updates(run: Path) -> str:
    """How many of a run's steps skipped each policy's update (no sample with signal: every
    advantage 0), from ``loss/<policy>/skipped`` (``loss/skipped`` for one policy); a step
    logged again after a resume counts once."""
    per_step: dict[str, dict[int, bool]] = collections.defaultdict(dict)
    with (run / "metrics.jsonl").open(encoding="utf-8") as rows:
        for line in rows:
            row = json.loads(line)
            for key, value in row.items():
                if key.startswith("loss/") and key.endswith("/skipped"):  # loss/skipped too
                    policy = key.removeprefix("loss/").removesuffix("skipped").rstrip("/")
                    per_step[policy][row.get("step", -1)] = bool(value)
    counts = {p: (sum(steps.values()), len(steps)) for p, steps in per_step.items()}
    return ", ".join(f"{p + ' ' if p else ''}{n} of {of}" for p, (n, of) in counts.items()) or "-"


def moves_table(root: Path) -> str:
    """Each run's training moves by quarter of its steps (:func:`training_moves`) and its
    skipped updates (:func:`skipped_updates`)."""
    quarters = " | ".join(f"steps, quarter {q}" for q in range(1, 5))
    lines = [f"| method | seed | {quarters} | updates skipped |", "|---|---|" + "---|" * 5]
    for method, seeds in _methods(root):
        for run in (s for s in seeds if (s / "samples.jsonl").is_file()):
            cfg = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
            prefix = cfg["env"].get("answer_prefix") or ""
            spans = training_moves(run, prefix, cfg["train"]["steps"])
            cells = [", ".join(f"{m} {n}" for m, n in span.items()) or "-" for span in spans]
            cells.append(skipped_updates(run) if (run / "metrics.jsonl").is_file() else "-")
            lines.append(f"| {method.name} | {run.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    moves = "--moves" in argv
    args = [a for a in argv if a != "--moves"]
    if not args or (len(args) < 2 and not moves):
        print(
            "usage: python -m atgrpo.experiments.match_table ROOT OPPONENT...  "
            "(or ROOT --moves: the moves each run played in training)",
            file=sys.stderr,
        )
        return 2
    root, opponents = Path(args[0]), args[1:]
    if moves:
        print(moves_table(root))
        return 0
    print(table(root, opponents) + "\n\n" + orderings(root, opponents))
    if _any_draws(root, opponents):
        print("\nGames not lost (won or drawn):\n")
        print(
            table(root, opponents, score=NOT_LOST)
            + "\n\n"
            + orderings(root, opponents, score=NOT_LOST)
        )
    return 0


def _any_draws(root: Path, opponents: list[str], split: str = "test") -> bool:
    folders = [root / "untrained"] + [s for _, seeds in _methods(root) for s in seeds]
    tallies = (_tally(f, opponent, split) for f in folders for opponent in opponents)
    return any(t is not None and t.draws for t in tallies)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
