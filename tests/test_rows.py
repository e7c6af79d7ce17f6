"""The one reader of data files (:mod:`atgrpo.data.rows`): every format to the same rows, and
every unreadable file to one line in the caller's error class."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from atgrpo.data.base import DatasetError
from atgrpo.data.code import CodeDatasetError
from atgrpo.data.rows import read_rows

ROWS = [{"question": "1+1", "answer": 2}, {"question": "2+2", "answer": 4}]


class OwnError(DatasetError):
    pass


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_every_format_gives_the_same_rows(tmp_path: Path) -> None:
    lines = "".join(json.dumps(r) + "\n\n" for r in ROWS)  # blank lines are skipped
    assert read_rows(_write(tmp_path / "a.jsonl", lines)) == ROWS
    assert read_rows(_write(tmp_path / "a.json", json.dumps(ROWS))) == ROWS
    assert read_rows(_write(tmp_path / "b.json", json.dumps({"data": ROWS}))) == ROWS
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(lines)
    assert read_rows(tmp_path / "a.jsonl.gz") == ROWS
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
        assert read_rows(tmp_path / "a.parquet") == ROWS


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("missing.jsonl", None, r"missing\.jsonl: no such file; get it there"),
        ("rows.csv", "a,b\n", r"rows\.csv: unknown format; use \.jsonl, \.jsonl\.gz"),
        ("bad.jsonl", '{"a": 1}\n{not json\n', r"bad\.jsonl:2: not JSON"),
        ("list.jsonl", '{"a": 1}\n[1, 2]\n', r"list\.jsonl: row 2 is not a JSON object"),
        ("bad.json", "{", r"bad\.json: not JSON"),
        ("scalar.json", "3", r"scalar\.json: expected a list of JSON objects"),
    ],
)
def test_an_unreadable_file_is_one_line_in_the_callers_error(
    tmp_path: Path, name: str, text: str | None, message: str
) -> None:
    path = tmp_path / name if text is None else _write(tmp_path / name, text)
    with pytest.raises(OwnError, match=message) as caught:
        read_rows(path, error=OwnError, hint="get it there")
    assert "\n" not in str(caught.value)


def test_the_loaders_raise_their_own_errors_through_the_reader(tmp_path: Path) -> None:
    from atgrpo.data.code import load_apps
    from atgrpo.data.math import MathDatasetError
    from atgrpo.data.math import read_rows as read_math_rows

    bad = _write(tmp_path / "bad.jsonl", "{not json\n")
    with pytest.raises(CodeDatasetError, match=r"bad\.jsonl:1: not JSON"):
        load_apps(bad)
    with pytest.raises(MathDatasetError, match=r"bad\.jsonl:1: not JSON"):
        read_math_rows(bad)
