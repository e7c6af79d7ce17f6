"""Rows of a local data file: the one reader of JSONL, JSON and parquet that the dataset env and
the math and code loaders share, with one set of one-line errors.

* ``.jsonl`` (and ``.jsonl.gz``): one JSON object a line, blank lines skipped;
* ``.json``: a list of objects, or an object holding one under ``"data"``;
* ``.parquet``: needs pyarrow (``pip install pyarrow``), read in batches.

Every row must be a JSON object (a dict). A caller passes its own error class (a
:class:`~atgrpo.data.base.DatasetError`), so its users catch what they caught before, and a
``hint`` that says where such files come from.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from atgrpo.data.base import DatasetError

FORMATS = (".jsonl", ".jsonl.gz", ".json", ".parquet")


def file_format(path: Path) -> str | None:
    """The format of ``path`` by its name (one of :data:`FORMATS`), or None."""
    name = path.name.lower()
    return next((f for f in sorted(FORMATS, key=len, reverse=True) if name.endswith(f)), None)


def iter_rows(
    path: str | Path, *, error: type[DatasetError] = DatasetError, hint: str = ""
) -> Iterator[dict[str, Any]]:
    """The rows of ``path``, one dict each; ``error`` (with ``hint`` after a missing file)
    names the file, and the line, of what cannot be read."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise error(f"{path}: no such file" + (f"; {hint}" if hint else ""))
    kind = file_format(path)
    if kind is None:
        raise error(f"{path}: unknown format; use {', '.join(FORMATS)}")
    if kind == ".parquet":
        rows: Iterator[Any] = _parquet(path, error)
    elif kind == ".json":
        rows = iter(_json_list(path, error))
    else:
        rows = _jsonl(path, error)
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise error(f"{path}: row {i} is not a JSON object; write one object per row")
        yield row


def read_rows(
    path: str | Path, *, error: type[DatasetError] = DatasetError, hint: str = ""
) -> list[dict[str, Any]]:
    """:func:`iter_rows` as a list."""
    return list(iter_rows(path, error=error, hint=hint))


def _jsonl(path: Path, error: type[DatasetError]) -> Iterator[Any]:
    opener: Any = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(
                    f"{path}:{line_no}: not JSON ({exc.msg}); write one JSON object per line"
                ) from None


def _json_list(path: Path, error: type[DatasetError]) -> list[Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path}: not JSON ({exc}); give a list of objects") from None
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        value = value["data"]
    if not isinstance(value, list):
        raise error(f'{path}: expected a list of JSON objects (or one under "data")')
    return value


def _parquet(path: Path, error: type[DatasetError]) -> Iterator[Any]:
    if importlib.util.find_spec("pyarrow") is None:
        raise error(f"{path}: reading parquet needs pyarrow: pip install pyarrow")
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
        yield from batch.to_pylist()
