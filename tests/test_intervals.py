"""Success intervals: Wilson over tasks, the bootstrap over tasks and seeds, paired differences."""

from __future__ import annotations

import numpy as np
import pytest

from atgrpo.experiments.intervals import (
    counts_difference,
    counts_interval,
    difference_interval,
    newcombe,
    report_gain,
    report_interval,
    success_interval,
    wilson,
)
from atgrpo.training.evaluation import TaskResult


def test_wilson_matches_the_textbook_values() -> None:
    low, high = wilson(6, 48)  # 12.5 %: the demo's untrained team
    assert low == pytest.approx(0.0586, abs=5e-4)
    assert high == pytest.approx(0.2470, abs=5e-4)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
    assert wilson(0, 0) == (0.0, 1.0)


def test_one_seed_uses_wilson_over_tasks() -> None:
    solved = np.array([[1] * 30 + [0] * 70])
    iv = success_interval(solved, episodes=1)
    assert iv.method == "wilson" and iv.mean == pytest.approx(0.3)
    assert (iv.low, iv.high) == pytest.approx(wilson(30, 100))


def test_seeds_that_disagree_widen_the_bootstrap_interval() -> None:
    rng = np.random.default_rng(1)
    agree = (rng.random((3, 100)) < 0.4).astype(int)
    same = np.repeat(agree[:1], 3, axis=0)  # three identical runs
    apart = np.stack([np.zeros(100), np.ones(100) * (rng.random(100) < 0.4), np.ones(100)])
    narrow = success_interval(same, episodes=1)
    wide = success_interval(apart.astype(int), episodes=1)
    assert narrow.method == "bootstrap" and narrow.low < narrow.mean < narrow.high
    assert wide.high - wide.low > 2 * (narrow.high - narrow.low)
    assert success_interval(same, 1) == narrow  # seeded: reproducible


def test_paired_difference_sees_a_consistent_gain_that_unpaired_noise_hides() -> None:
    rng = np.random.default_rng(2)
    base = (rng.random((1, 100)) < 0.5).astype(int)
    better = base.copy()
    better[0, np.flatnonzero(base[0] == 0)[:10]] = 1  # 10 more tasks solved, none lost
    diff = difference_interval(np.repeat(better, 3, 0), base, episodes=1)
    assert diff.mean == pytest.approx(0.10)
    assert diff.low > 0  # paired over tasks: the gain is outside the noise
    with pytest.raises(ValueError, match="task counts"):
        difference_interval(better, base[:, :50], episodes=1)


def test_rejects_a_malformed_cell() -> None:
    with pytest.raises(ValueError, match="shape"):
        success_interval(np.array([1, 0, 1]), episodes=1)


def _tasks(solved: list[int], seeds: list[int] | None = None) -> list[TaskResult]:
    seeds = seeds or list(range(len(solved)))
    pairs = zip(solved, seeds, strict=True)
    return [TaskResult(i, s, None, c, 1, 0.0) for i, (c, s) in enumerate(pairs)]


def test_an_evaluation_gets_its_wilson_interval_and_a_training_gain_a_paired_one() -> None:
    before = _tasks([1] * 27 + [0] * 73)
    after = _tasks([1] * 27 + [1] * 30 + [0] * 43)  # the same 27, 30 more
    one = report_interval(before)
    assert (one.low, one.high) == pytest.approx(wilson(27, 100))
    gain = report_gain(after, before)
    assert gain is not None and gain.mean == pytest.approx(0.30)
    assert 0.2 < gain.low < 0.30 < gain.high < 0.4  # paired: far narrower than two Wilsons
    assert report_gain(after, _tasks([0] * 100, seeds=list(range(1, 101)))) is None  # other tasks


def test_counts_of_one_seed_get_wilson_and_of_seeds_that_disagree_a_wider_bootstrap() -> None:
    one = counts_interval([66], [200])
    assert one.method == "wilson" and (one.low, one.high) == pytest.approx(wilson(66, 200))
    agree = counts_interval([66, 66, 66], [200, 200, 200])
    apart = counts_interval([140, 44, 44], [200, 200, 200])  # one run trained, two did not
    assert agree.method == "bootstrap" and agree.mean == pytest.approx(0.33)
    assert agree.low < 0.33 < agree.high
    assert apart.mean == pytest.approx(0.38)
    assert apart.high - apart.low > 3 * (agree.high - agree.low)
    assert counts_interval([140, 44, 44], [200, 200, 200]) == apart  # seeded: reproducible
    with pytest.raises(ValueError, match="wins and games per seed"):
        counts_interval([1, 2], [10])
    with pytest.raises(ValueError, match=r"\[0, games\]"):
        counts_interval([11], [10])


def test_a_counts_difference_is_clear_of_0_only_when_the_seeds_agree() -> None:
    trained = ([98, 102, 100], [200, 200, 200])
    untrained = ([41], [200])
    gain = counts_difference(trained, untrained)
    assert gain.mean == pytest.approx(0.295) and gain.low > 0.15
    lucky = counts_difference(([140, 44, 44], [200, 200, 200]), untrained)
    assert lucky.low < 0 < lucky.high  # one seed of three: not shown
    assert counts_difference(untrained, trained).high < 0


def test_counts_at_0_keep_the_score_interval_that_the_resampling_loses() -> None:
    # Every seed at 0 % resamples to 0 % alone: 0 of 150 games is not a certainty.
    none = counts_interval([0, 0, 0], [50, 50, 50])
    assert none.mean == 0.0 and (none.low, none.high) == pytest.approx(wilson(0, 150))
    assert none.high > 0.02
    both_zero = counts_difference(([0, 0, 0], [50, 50, 50]), ([0], [50]))
    assert both_zero.low < 0 < both_zero.high  # not "+0.0 [+0.0, +0.0]"
    floor = newcombe((0, 150), (0, 50))
    assert (both_zero.low, both_zero.high) == pytest.approx((floor.low, floor.high))
    # Newcombe's interval, hybrid score (method 10): 56/70 minus 48/80, [0.0524, 0.3339]
    textbook = newcombe((56, 70), (48, 80))
    assert textbook.mean == pytest.approx(0.2)
    assert (textbook.low, textbook.high) == pytest.approx((0.0524, 0.3339), abs=1e-4)
