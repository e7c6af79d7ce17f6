"""Dataset loaders: packaged benchmarks and local JSONL / JSON / parquet files as typed problems.

Nothing is fetched from a hub at run time; a missing package or file is a one-line error that
says how to get it. One module per task family; import from it (``atgrpo.data.math``, ...).
"""

from __future__ import annotations

from atgrpo.data.base import DatasetError

# --- math (data/math.py; docs/datasets-math.md) -----------------------------------------------
from atgrpo.data.math import (
    Benchmark,
    MathDataConfig,
    MathDatasetError,
    MathProblem,
    MathSplits,
    TrainSource,
    extract_boxed,
    load_splits,
    verify,
)

__all__ = [
    # math
    "Benchmark",
    "DatasetError",
    "MathDataConfig",
    "MathDatasetError",
    "MathProblem",
    "MathSplits",
    "TrainSource",
    "extract_boxed",
    "load_splits",
    "verify",
]
