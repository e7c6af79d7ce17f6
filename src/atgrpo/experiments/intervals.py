"""Confidence intervals for success rates: Wilson over tasks, a bootstrap over tasks and seeds.

A comparison's cell is one method on one benchmark: ``S`` training seeds (one run each; an
untrained method has one), each evaluated on the same ``T`` held-out tasks, task ``t`` of seed
``s`` solved ``c[s, t]`` of ``n`` times. Its success is the mean of ``c / n`` over seeds and
tasks.

* One seed: the Wilson score interval of ``sum c`` successes in ``T * n`` trials (tasks as
  independent draws; with n > 1 the episodes of one task are not independent, so it is a little
  narrow then).
* Several seeds: a two-level bootstrap. Each resample draws ``S`` seeds with replacement and
  ``T`` tasks with replacement (the same tasks for every seed drawn), and takes the mean; the
  interval is the 2.5 / 97.5 percentiles of ``B`` resamples. It covers both sources of noise: which
  tasks were held out, and how a training run went.
* A difference between two cells of one benchmark is paired over tasks: both cells' resamples use
  the same task draws, their seeds drawn independently.
* A cell known by counts alone (a match's ``wins[s]`` of ``games[s]`` per seed, no outcome per
  game): Wilson for one seed; for several the same two levels, a drawn seed's games drawn again
  with replacement (a binomial draw at its own rate). Differences of such cells are unpaired.
  The resampling cannot move a rate of 0 or 1 (every seed at 0 % resamples to 0 %), so such an
  interval is never narrower than the score interval over the games pooled: Wilson's for a
  rate, Newcombe's (Wilson's of each side) for a difference.

Resamples come from a seeded generator, so a table is reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    method: str  # "wilson" or "bootstrap"

    def percent(self) -> str:
        """``'18.8 [11.0, 30.1]'``: the mean and the interval in percent."""
        return f"{100 * self.mean:.1f} [{100 * self.low:.1f}, {100 * self.high:.1f}]"


def wilson(successes: float, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion; (0, 1) without trials."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _rates(solved: np.ndarray, episodes: int) -> np.ndarray:
    rates = np.asarray(solved, dtype=np.float64) / episodes
    if rates.ndim != 2 or rates.size == 0:
        raise ValueError(f"expected successes of shape (seeds, tasks), got {rates.shape}")
    return rates


def success_interval(
    solved: np.ndarray,  # (S, T) successes per seed and task
    episodes: int,  # n per task
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """The cell's success with its 95 % interval (module docstring)."""
    rates = _rates(solved, episodes)
    mean = float(rates.mean())
    if rates.shape[0] == 1:
        low, high = wilson(float(rates.sum()) * episodes, rates.size * episodes)
        return Interval(mean, low, high, "wilson")
    rng = np.random.default_rng(seed)
    tasks = rng.integers(0, rates.shape[1], size=(resamples, rates.shape[1]))
    means = _resampled_means(rates, tasks, rng)
    low, high = np.percentile(means, [2.5, 97.5])
    return Interval(mean, float(low), float(high), "bootstrap")


def difference_interval(
    solved: np.ndarray,  # (S_a, T) of the cell
    baseline: np.ndarray,  # (S_b, T) of the baseline, the same tasks in the same order
    episodes: int,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """Success of ``solved`` minus ``baseline``, paired over tasks, with its 95 % interval."""
    a, b = _rates(solved, episodes), _rates(baseline, episodes)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"cells have different task counts: {a.shape[1]} and {b.shape[1]}")
    rng = np.random.default_rng(seed)
    tasks = rng.integers(0, a.shape[1], size=(resamples, a.shape[1]))
    diffs = _resampled_means(a, tasks, rng) - _resampled_means(b, tasks, rng)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return Interval(float(a.mean() - b.mean()), float(low), float(high), "bootstrap")


def counts_interval(
    wins: list[int],
    games: list[int],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """The win rate of ``sum(wins)`` of ``sum(games)``, seeds pooled, with its 95 % interval
    (module docstring: counts alone)."""
    won, played = _counts(wins, games)
    mean = float(won.sum() / played.sum())
    if len(won) == 1:
        return Interval(mean, *wilson(float(won[0]), int(played[0])), "wilson")
    rates = _count_rates(won, played, resamples, np.random.default_rng(seed))
    low, high = np.percentile(rates, [2.5, 97.5])
    score_low, score_high = wilson(float(won.sum()), int(played.sum()))
    return Interval(mean, min(float(low), score_low), max(float(high), score_high), "bootstrap")


def counts_difference(
    a: tuple[list[int], list[int]],  # (wins, games) per seed
    b: tuple[list[int], list[int]],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """Win rate of ``a`` minus ``b`` (each ``(wins, games)`` per seed), unpaired, with its 95 %
    interval: both resampled on their own, the seeds and then the games."""
    (wa, ga), (wb, gb) = _counts(*a), _counts(*b)
    rng = np.random.default_rng(seed)
    diffs = _count_rates(wa, ga, resamples, rng) - _count_rates(wb, gb, resamples, rng)
    low, high = np.percentile(diffs, [2.5, 97.5])
    score = newcombe((int(wa.sum()), int(ga.sum())), (int(wb.sum()), int(gb.sum())))
    low, high = min(float(low), score.low), max(float(high), score.high)
    return Interval(score.mean, low, high, "bootstrap")


def newcombe(a: tuple[int, int], b: tuple[int, int]) -> Interval:
    """``a``'s rate minus ``b``'s (each ``(successes, trials)``, independent) with Newcombe's
    hybrid score interval: each side's Wilson interval, combined."""
    (sa, na), (sb, nb) = a, b
    pa, pb = sa / na, sb / nb
    (la, ua), (lb, ub) = wilson(sa, na), wilson(sb, nb)
    low = pa - pb - math.sqrt((pa - la) ** 2 + (ub - pb) ** 2)
    high = pa - pb + math.sqrt((ua - pa) ** 2 + (pb - lb) ** 2)
    return Interval(pa - pb, low, high, "newcombe")


def _counts(wins: list[int], games: list[int]) -> tuple[np.ndarray, np.ndarray]:
    won, played = np.asarray(wins, dtype=np.int64), np.asarray(games, dtype=np.int64)
    if won.shape != played.shape or won.ndim != 1 or not len(won) or (played <= 0).any():
        raise ValueError(f"expected wins and games per seed, games > 0; got {wins} of {games}")
    if ((won < 0) | (won > played)).any():
        raise ValueError(f"wins must lie in [0, games]; got {wins} of {games}")
    return won, played


def _count_rates(
    won: np.ndarray, played: np.ndarray, resamples: int, rng: np.random.Generator
) -> np.ndarray:
    """(B,) pooled win rates: draw S seeds with replacement, then each one's games."""
    seeds = rng.integers(0, len(won), size=(resamples, len(won)))  # (B, S)
    games = played[seeds]
    redrawn = rng.binomial(games, won[seeds] / games)
    return redrawn.sum(axis=1) / games.sum(axis=1)


def report_interval(tasks: list[Any]) -> Interval:
    """One evaluation's success with its Wilson interval (``EvalReport.tasks``)."""
    solved = np.array([[t.successes for t in tasks]], dtype=np.float64)
    return success_interval(solved, episodes=tasks[0].episodes if tasks else 1)


def report_gain(after: list[Any], before: list[Any]) -> Interval | None:
    """Success after minus before on the same tasks, paired; None when the tasks differ."""
    if not after or [t.seed for t in after] != [t.seed for t in before]:
        return None
    a = np.array([[t.successes for t in after]], dtype=np.float64)
    b = np.array([[t.successes for t in before]], dtype=np.float64)
    return difference_interval(a, b, episodes=after[0].episodes)


def _resampled_means(rates: np.ndarray, tasks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(B,) means of ``rates`` (S, T) over B draws of S seeds and the given T task indices."""
    resamples = tasks.shape[0]
    seeds = rng.integers(0, rates.shape[0], size=(resamples, rates.shape[0]))  # (B, S)
    per_seed = rates[seeds]  # (B, S, T)
    picked = np.take_along_axis(per_seed, tasks[:, None, :].repeat(rates.shape[0], 1), axis=2)
    return picked.mean(axis=(1, 2))
