"""Train / validation / test splits of generated task instances.

This module is where invariant 5 of docs/design.md ("the train, validation and test seed ranges are
disjoint and the code says where") lives for generated envs. Two mechanisms, both needed:

* **Disjoint seed ranges** (:data:`SEED_RANGES`, :func:`split_seeds`): the seeds a run draws
  for each split never overlap, so logs and reports never mix them up.
* **Instance buckets** (:func:`split_of`): seeds alone do not make splits disjoint, because a
  small grid has few distinct instances and two seeds can generate the same one. Every generated
  instance has a canonical ``instance_key``; a stable hash of that key puts it in exactly one
  split (80 / 10 / 10). A generator seeded with ``seed`` draws candidates until one falls in the
  requested split's bucket, so an instance of the test split can never be trained on, whatever
  the seeds.
"""

from __future__ import annotations

import enum
import hashlib


class Split(enum.StrEnum):
    TRAIN = "train"
    VALIDATION = "validation"
    TEST = "test"


# Seeds [start, stop) per split; one billion seeds each is far more than any run draws.
SEED_RANGES: dict[Split, range] = {
    Split.TRAIN: range(0, 1_000_000_000),
    Split.VALIDATION: range(1_000_000_000, 2_000_000_000),
    Split.TEST: range(2_000_000_000, 3_000_000_000),
}

# Share of instances per split, in percent of the hash buckets 0..99 (80/10/10).
SPLIT_PERCENT: dict[Split, int] = {Split.TRAIN: 80, Split.VALIDATION: 10, Split.TEST: 10}


def split_seeds(split: Split | str, count: int, start: int = 0) -> list[int]:
    """``count`` seeds of ``split``'s range, beginning at offset ``start`` inside it."""
    seeds = SEED_RANGES[Split(split)]
    if count < 0 or start < 0:
        raise ValueError(f"count and start must be >= 0, got count={count}, start={start}")
    if start + count > len(seeds):
        raise ValueError(f"split {Split(split).value!r} has only {len(seeds)} seeds")
    return list(seeds[start : start + count])


def split_of(instance_key: str) -> Split:
    """The split an instance belongs to: a stable hash bucket of its canonical key.

    sha256 rather than ``hash()``: Python's string hash is salted per process.
    """
    digest = hashlib.sha256(instance_key.encode("utf-8", errors="surrogatepass")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    upper = 0
    for split, percent in SPLIT_PERCENT.items():
        upper += percent
        if bucket < upper:
            return split
    raise AssertionError("SPLIT_PERCENT must add up to 100")
