"""`atgrpo compare`: methods x benchmarks on the same held-out tasks -> table.md / table.csv."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from atgrpo.config import ConfigError, load_config
from atgrpo.envs import Split
from atgrpo.experiments.compare import (
    BenchmarkSpec,
    Comparison,
    Difference,
    Method,
    cell_config,
    load_comparison,
    run_comparison,
)
from atgrpo.experiments.tables import (
    TableCell,
    difference_rows,
    markdown_table,
    table_rows,
    training_seconds,
    write_tables,
)
from atgrpo.training.evaluation import EvalReport, TaskResult
from atgrpo.training.loop import train
from conftest import REPO

FAST = ["rollout.max_prompt_tokens=2048", "rollout.max_new_tokens=8"]


def _report(success: float, tasks: int = 100, **kw: object) -> EvalReport:
    solved = round(success * tasks)
    results = [TaskResult(i, i, None, int(i < solved), 1, 0.0) for i in range(tasks)]
    return EvalReport("test", tasks, solved / tasks, 0.0, tasks=results, **kw)  # type: ignore[arg-type]


def _cell(method: str, bench: str, *successes: float, **kw: object) -> TableCell:
    reports = [_report(s, **kw) for s in successes]
    seeds = list(range(len(reports)))
    return TableCell(method, bench, reports, [""] * len(reports), "c.yaml", seeds)


def test_table_has_success_intervals_and_the_delta_to_the_first_row(tmp_path: Path) -> None:
    cells = [
        _cell("Single agent", "Plan-Path", 0.05),
        _cell("Single agent", "Sudoku", 0.07),
        _cell("MAS", "Plan-Path", 0.10),
        _cell("MAS", "Sudoku", 0.69),
        _cell("MAS + AT-GRPO", "Plan-Path", 0.90, 0.96, 0.93),
        _cell("MAS + AT-GRPO", "Sudoku", 0.99, 0.99, 0.99),
    ]
    header, rows = table_rows(cells)
    assert header == ["Method", "seeds", "Plan-Path", "Sudoku"]
    assert rows[0] == ["Single agent", "1", "5.0 [2.2, 11.2]", "7.0 [3.4, 13.7]"]  # Wilson
    assert rows[1][:2] == ["MAS", "1"]
    assert rows[1][2].startswith("10.0 [") and "; +5.0 [" in rows[1][2]
    agrpo = rows[2]
    assert agrpo[1] == "3" and agrpo[2].startswith("93.0 [") and "; +88.0 [+" in agrpo[2]
    md = markdown_table(cells)
    assert md.splitlines()[0] == "| Method | seeds | Plan-Path | Sudoku |"
    assert "on 100 test tasks per benchmark (greedy)" in md
    md_path, csv_path = write_tables(cells, tmp_path)
    assert md_path.read_text() == md
    lines = list(csv.DictReader(csv_path.open()))
    assert [(r["method"], r["benchmark"], r["success"], r["delta"]) for r in lines[:3]] == [
        ("Single agent", "Plan-Path", "5.00", "0.00"),
        ("Single agent", "Sudoku", "7.00", "0.00"),
        ("MAS", "Plan-Path", "10.00", "5.00"),
    ]
    last = lines[-1]
    assert last["seeds"] == "0 1 2" and last["success_per_seed"] == "99.00 99.00 99.00"
    assert float(last["success_low"]) <= 99.0 <= float(last["success_high"])
    assert float(last["delta_low"]) > 0  # 99 vs 7 on the same 100 tasks


def test_a_row_is_compared_with_its_versus_row(tmp_path: Path) -> None:
    cells = [
        _cell("Single agent", "Arith", 0.0),
        _cell("MAS", "Arith", 0.27),
        _cell("MAS + AT-GRPO", "Arith", 0.55, 0.61),
    ]
    cells[2].versus = "MAS"
    _, rows = table_rows(cells)
    assert rows[1][2].startswith("27.0 [19.3, 36.4]; +27.0 [+") and rows[1][2].endswith("]")
    assert "; +31.0 [+" in rows[2][2] and rows[2][2].endswith("] vs MAS")
    _, csv_path = write_tables(cells, tmp_path)
    last = list(csv.DictReader(csv_path.open()))[-1]
    assert (last["delta"], last["delta_versus"]) == ("31.00", "MAS")
    with pytest.raises(ValueError, match=r"methods\.1\.versus: no other method"):
        Comparison.model_validate(
            {
                "benchmarks": [{"name": "Arith"}],
                "methods": [
                    {"label": "a", "config": "c.yaml"},
                    {"label": "b", "config": "c.yaml", "versus": "b"},
                ],
            }
        )


def test_further_differences_get_a_table_of_their_own(tmp_path: Path) -> None:
    cells = [
        _cell("Single agent", "Arith", 0.0),
        _cell("MAS", "Arith", 0.27),
        _cell("MAS + AT-GRPO", "Arith", 0.55, 0.61),
    ]
    pairs = [Difference(method="MAS + AT-GRPO", versus="MAS")]
    header, rows = difference_rows(cells, pairs)
    assert header == ["Method", "against", "Arith"]
    assert rows[0][:2] == ["MAS + AT-GRPO", "MAS"] and rows[0][2].startswith("+31.0 [+")
    _, main = table_rows(cells)
    assert main[2][2].split("; ")[1] != rows[0][2]  # the main table stays against the first row
    md_path, _ = write_tables(cells, tmp_path, pairs)
    assert f"| MAS + AT-GRPO | MAS | {rows[0][2]} |" in md_path.read_text()
    assert "Further differences" not in markdown_table(cells)
    raw = {"benchmarks": [{"name": "Arith"}], "methods": [{"label": "a", "config": "c.yaml"}]}
    for pair, error in [
        ({"method": "a", "versus": "b"}, r"differences\.0\.versus: no method is labelled 'b'"),
        ({"method": "a", "versus": "a"}, r"differences\.0: a row against itself"),
    ]:
        with pytest.raises(ValueError, match=error):
            Comparison.model_validate({**raw, "differences": [pair]})


def test_csv_has_pass_at_k_columns_when_sampled(tmp_path: Path) -> None:
    sampled = {"samples_per_task": 4, "pass_at": {1: 0.25, 4: 0.5}}
    cells = [_cell("A", "P", 0.25, **sampled), _cell("B", "P", 0.5, **sampled)]
    _, csv_path = write_tables(cells, tmp_path)
    rows = list(csv.DictReader(csv_path.open()))
    assert rows[1]["pass@1"] == "25.00" and rows[1]["pass@4"] == "50.00"
    assert "avg@4 (sampled)" in (tmp_path / "table.md").read_text()


def test_training_time_sums_each_kept_step_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    final = run / "checkpoints" / "step-000003"
    final.mkdir(parents=True)
    records = [
        {"step": 1, "perf/step_s": 10.0},
        {"step": 2, "perf/step_s": 99.0},  # lost: the run was killed, resumed from step 1
        {"step": 2, "perf/step_s": 20.0},
        {"event": "resume"},
        {"step": 3, "perf/step_s": 30.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert training_seconds(str(final)) == 60.0
    assert training_seconds("") is None  # an untrained row
    assert training_seconds(str(tmp_path / "elsewhere" / "checkpoints" / "step-1")) is None
    cell = TableCell("A", "P", [_report(0.5)], [str(final)], "c.yaml")
    assert cell.training_seconds() == [60.0]
    md = markdown_table([cell])
    assert "| A | P | 1.0 [1.0, 1.0] |" in md


def test_a_benchmark_env_replaces_the_env_but_not_the_methods_workflow() -> None:
    comparison = Comparison(
        eval={"num_tasks": 3, "samples_per_task": 2},
        benchmarks=[BenchmarkSpec(name="6x6", env={"name": "plan_path", "grid_size": 6})],
        methods=[Method(label="single", config=str(REPO / "configs" / "tiny-single.yaml"))],
    )
    cfg = cell_config(comparison, comparison.methods[0], comparison.benchmarks[0])
    assert cfg.env.grid_size == 6 and cfg.env.workflow.value == "single"
    assert cfg.env.max_turns == load_config(None).env.max_turns  # tiny.yaml's env is replaced
    assert (cfg.eval.num_tasks, cfg.eval.samples_per_task) == (3, 2)


def test_every_cell_is_evaluated_on_the_same_split() -> None:
    comparison = Comparison(
        split=Split.VALIDATION,
        benchmarks=[
            BenchmarkSpec(name="a"),
            BenchmarkSpec(name="b", overrides=["env.grid_size=5"]),
        ],
        methods=[
            Method(label="x", config=str(REPO / "configs" / "tiny.yaml")),
            Method(label="y", config=str(REPO / "configs" / "tiny-single.yaml")),
        ],
    )
    calls = []

    def fake(cfg, checkpoint, split):
        calls.append((cfg.env.grid_size, cfg.env.workflow.value, checkpoint, split))
        return EvalReport(split.value, 1, 0.5, 0.0)

    cells = run_comparison(comparison, evaluate=fake, cache=False)
    assert [(c.method, c.benchmark) for c in cells] == [
        ("x", "a"), ("y", "a"), ("x", "b"), ("y", "b"),
    ]  # fmt: skip
    assert calls == [
        (4, "mas", None, Split.VALIDATION),
        (4, "single", None, Split.VALIDATION),
        (5, "mas", None, Split.VALIDATION),
        (5, "single", None, Split.VALIDATION),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("methods: []\nbenchmarks: [{name: a}]", "invalid value for 'methods'"),
        (
            "methods: [{label: x, config: c.yaml, oops: 1}]\nbenchmarks: [{name: a}]",
            "'methods.0.oops'",
        ),
        (
            "benchmarks: [{name: a}, {name: b}]\n"
            "methods: [{label: x, config: c.yaml, checkpoint: {a: runs/x}}]",
            "methods.0.checkpoint has no entry for benchmark(s) ['b']",
        ),
        (
            "methods:\n  - label: a\n    overrides: [eval.ablate=[tool]]\n",
            "is not valid YAML (line 3): expected ',' or ']', but got '['; a value holding",
        ),
    ],
)
def test_comparison_file_errors_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cmp.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_comparison(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_compare_produces_the_plan_path_table_with_the_tiny_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped tiny table, every paper row, on runs trained here for one step each."""
    from atgrpo.cli import main

    for config, name in [
        ("tiny-single-grpo.yaml", "tiny-single-grpo"),
        ("tiny.yaml", "tiny"),
        ("tiny-lora.yaml", "tiny-lora"),
    ]:
        overrides = [f"run.output_dir={tmp_path / 'runs'}", f"run.name={name}", "train.steps=1"]
        train(load_config(REPO / "configs" / config, [*overrides, *FAST]))
    spec = yaml.safe_load((REPO / "configs" / "compare" / "tiny-table.yaml").read_text())
    for method in spec["methods"]:
        method["config"] = str(REPO / method["config"])
        if method.get("checkpoint"):
            method["checkpoint"] = str(tmp_path / method["checkpoint"])
    spec["output_dir"] = str(tmp_path / "table")
    path = tmp_path / "tiny-table.yaml"
    path.write_text(yaml.safe_dump(spec))

    assert main(["compare", str(path)]) == 0
    out = capsys.readouterr().out
    assert "[6/6] Plan-Path 4x4 | MAS + AT-GRPO (per-role LoRA), policies swapped" in out
    md = (tmp_path / "table" / "table.md").read_text().splitlines()
    assert md[0] == "| Method | seeds | Plan-Path 4x4 |"
    labels = [row.split(" | ")[0].removeprefix("| ") for row in md[2:8]]
    assert labels == [m["label"] for m in spec["methods"]]
    assert all("; " in row for row in md[3:8])  # every row after the first shows its delta
    rows = list(csv.DictReader((tmp_path / "table" / "table.csv").open()))
    assert len(rows) == 6 and rows[0]["delta"] == "0.00"
    assert {r["num_tasks"] for r in rows} == {"2"} and {r["split"] for r in rows} == {"test"}
    assert rows[1]["checkpoints"].endswith("step-000001") and rows[0]["checkpoints"] == ""
    assert "Further differences" in out  # the file's differences: printed and in table.md
    assert md[md.index("| Method | against | Plan-Path 4x4 |") + 2].startswith(
        "| MAS + AT-GRPO (per-role LoRA), policies swapped | MAS + AT-GRPO (per-role LoRA) | "
    )


def _grid_file(tmp_path: Path, seeds: list[int]) -> Path:
    spec = {
        "output_dir": str(tmp_path / "grid"),
        "seeds": seeds,
        "eval": {"num_tasks": 2, "max_new_tokens": 8},
        "benchmarks": [{"name": "Plan-Path 4x4"}],
        "methods": [
            {"label": "MAS (no training)", "config": str(REPO / "configs" / "tiny.yaml")},
            {
                "label": "MAS + AT-GRPO",
                "config": str(REPO / "configs" / "tiny.yaml"),
                "train": True,
                "overrides": [*FAST, "train.steps=2"],
            },
            {
                "label": "swapped",
                "config": str(REPO / "configs" / "tiny.yaml"),
                "runs_of": "MAS + AT-GRPO",
                "overrides": [*FAST, "train.steps=2"],
            },
        ],
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_compare_train_trains_resumes_and_caches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--train trains each seed's run in its own process, resumes a half-finished one, and a
    second call trains and evaluates nothing again."""
    from atgrpo.cli import main
    from atgrpo.experiments.compare import RunSpec, planned_runs
    from atgrpo.experiments.runs import RunStatus, grid_status, train_run

    path = _grid_file(tmp_path, seeds=[0, 1])
    comparison = load_comparison(path)
    assert main(["compare", str(path)]) == 2  # nothing trained yet: one line names --train
    assert "--train" in capsys.readouterr().err
    # Seed 0 stopped after step 1 of 2: its checkpoint is at step 1.
    half = planned_runs(comparison)[0]
    one_step = half.cfg.model_copy(deep=True)
    one_step.train.steps = 1
    short = RunStatus(RunSpec(half.method, half.bench, half.seed, one_step), "missing", 0)
    train_run(comparison, short, tmp_path / "first.log")
    assert [(s.state, s.step) for s in grid_status(comparison)] == [("partial", 1), ("missing", 0)]

    assert main(["compare", str(path), "--train"]) == 0
    out = capsys.readouterr().out
    assert "resuming from step 1: MAS + AT-GRPO | Plan-Path 4x4 | seed 0" in out
    assert "training: MAS + AT-GRPO | Plan-Path 4x4 | seed 1" in out
    assert "[3/3] Plan-Path 4x4 | swapped: success" in out and "(mean of 2 seeds)" in out
    metrics = half.run_dir / "metrics.jsonl"
    steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]
    assert sorted(set(steps)) == [1, 2]
    rows = list(csv.DictReader((tmp_path / "grid" / "table.csv").open()))
    assert [r["seeds"] for r in rows] == ["0", "0 1", "0 1"]
    times = [r["train_s_per_seed"].split() for r in rows]
    assert times[0] == [] and len(times[1]) == 2 and all(float(t) > 0 for t in times[1])
    md = (tmp_path / "grid" / "table.md").read_text()
    assert "| MAS + AT-GRPO | Plan-Path 4x4 | " in md and "training time per run, min" in md
    assert "learning curves:" in out
    png = (tmp_path / "grid" / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    from atgrpo.experiments.compare import trained_runs

    runs = trained_runs(comparison)["Plan-Path 4x4"]
    assert list(runs) == ["MAS + AT-GRPO"] and len(runs["MAS + AT-GRPO"]) == 2
    evals = sorted((tmp_path / "grid" / "evals").rglob("*.json"))
    assert len(evals) == 5  # 1 untrained + 2 x 2 trained
    stamps = [p.stat().st_mtime_ns for p in evals]

    assert main(["compare", str(path), "--train"]) == 0
    out = capsys.readouterr().out
    assert "runs: 2 planned, 2 were already finished" in out and "training:" not in out
    assert [p.stat().st_mtime_ns for p in evals] == stamps  # read back, not evaluated again


def test_seeds_picks_some_of_the_files_seeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from atgrpo.cli import main

    path = _grid_file(tmp_path, seeds=[0, 1, 2])
    assert main(["compare", str(path), "--status", "--seeds", "2,0"]) == 0
    listed = [line.split("seed ")[1].split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == ["0", "2"]  # the file's order, seed 1 left out
    assert main(["compare", str(path), "--status", "--seeds", "3"]) == 2
    assert "[3] not among the file's seeds [0, 1, 2]" in capsys.readouterr().err


def test_a_sigterm_to_the_runner_reaches_the_training_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler that signals the runner's pid alone still stops the run it trains."""
    import os
    import signal
    import sys
    import threading

    from atgrpo.experiments.compare import planned_runs
    from atgrpo.experiments.runs import RunFailedError, RunStatus, train_run

    marker = tmp_path / "stopped"
    fake = tmp_path / "python"  # stands in for `python -m atgrpo train`: waits for SIGTERM
    fake.write_text(
        f"#!/bin/sh\ntrap 'touch {marker}; exit 143' TERM\nwhile :; do sleep 0.1; done\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    comparison = load_comparison(_grid_file(tmp_path, seeds=[0]))
    spec = planned_runs(comparison)[0]
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(RunFailedError, match="code 143"):
        train_run(comparison, RunStatus(spec, "missing", 0), tmp_path / "run.log")
    assert marker.is_file()


def test_a_recorded_grid_finishes_its_table_where_the_run_folders_are_gone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With record_dir, a finished run leaves its record; on a machine without the run folders
    --train trains nothing and the table (times, curves) comes from the records."""
    import shutil

    from atgrpo.checkpoint import weights_digest
    from atgrpo.cli import main

    path = _grid_file(tmp_path, seeds=[0])
    spec = yaml.safe_load(path.read_text())
    spec["record_dir"] = str(tmp_path / "kept")
    path.write_text(yaml.safe_dump(spec))
    assert main(["compare", str(path), "--train"]) == 0
    out = capsys.readouterr().out
    # each run's cells are evaluated as soon as it is recorded, before the table is made
    trained_at, table_at = out.index("evaluated MAS + AT-GRPO | seed 0"), out.index("[1/3]")
    assert trained_at < out.index("evaluated swapped | seed 0") < table_at
    table = (tmp_path / "grid" / "table.csv").read_text()
    kept = tmp_path / "kept" / "runs" / "plan-path-4x4" / "mas-at-grpo" / "seed0"
    record = json.loads((kept / "record.json").read_text())
    assert record["steps"] == 2 and record["checkpoint"].endswith("step-000002")
    assert record["weights_sha256"] == weights_digest(Path(record["checkpoint"]))
    assert record["weights_dtype"] is None  # a full checkpoint: fp32 master weights, not known
    curve = [json.loads(line) for line in (kept / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve] == [1, 2] and "rollout/success" in curve[0]
    assert {"reward/tool/mean", "perf/rollout_s", "loss/clip_frac"} <= curve[0].keys()
    evals = sorted((tmp_path / "kept" / "evals").rglob("*.json"))
    assert len(evals) == 3 and not list((tmp_path / "kept").rglob("*samples*"))
    assert len(list((tmp_path / "grid" / "evals").rglob("*-samples.jsonl"))) == 3

    assert main(["groups", str(kept)]) == 0  # the group statistics, from the record
    from atgrpo.experiments.runs import train_grid

    trained = [p for p in evals if "no-training" not in str(p)]
    for p in trained:  # as if --train had been stopped between recording and evaluating
        p.unlink()
    seen: list[str] = []
    train_grid(load_comparison(path), on_eval=lambda spec, row, report: seen.append(row))
    assert seen == ["MAS + AT-GRPO", "swapped"] and all(p.is_file() for p in trained)
    shutil.rmtree(tmp_path / "grid")  # another machine: the records alone
    capsys.readouterr()
    assert main(["compare", str(path), "--status"]) == 0
    assert capsys.readouterr().out.startswith("recorded    2/2  MAS + AT-GRPO")
    assert main(["compare", str(path), "--train"]) == 0
    out = capsys.readouterr().out
    assert "runs: 1 planned, 1 were already finished" in out and "training:" not in out
    assert (tmp_path / "grid" / "table.csv").read_text() == table
    assert (tmp_path / "grid" / "curves.png").read_bytes().startswith(b"\x89PNG")

    spec["methods"].append({**spec["methods"][2], "label": "new row"})
    path.write_text(yaml.safe_dump(spec))
    assert main(["compare", str(path)]) == 2  # a new row needs the checkpoint itself
    err = capsys.readouterr().err.strip()
    assert "is not on this machine" in err and "delete its record" in err and "\n" not in err

    spec["methods"][1]["overrides"].append("train.lr=2e-6")  # another config: train again
    path.write_text(yaml.safe_dump(spec))
    assert main(["compare", str(path), "--status"]) == 0
    assert capsys.readouterr().out.startswith("missing     0/2  MAS + AT-GRPO")


def test_git_keeps_every_comparison_s_records() -> None:
    """A record_dir is committed: no ignore rule (e.g. one for run folders) may swallow it."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    kept = []
    for path in sorted((REPO / "configs" / "compare").glob("*.yaml")):
        record_dir = yaml.safe_load(path.read_text()).get("record_dir")
        if record_dir:
            kept += [f"{record_dir}/runs/b/m/seed0/record.json", f"{record_dir}/evals/b/m/s.json"]
    assert kept, "no comparison keeps records"
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *kept], cwd=REPO, capture_output=True, text=True
    )
    assert ignored.stdout == "", f"git ignores records: {ignored.stdout}"


def test_an_evaluation_is_kept_for_the_weights_it_evaluated(tmp_path: Path) -> None:
    """A run trained again at the same path (same config, same checkpoint name) is evaluated
    again: the cache is keyed on the checkpoint's weights digest too."""
    from atgrpo.experiments.compare import cached_evaluation

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    calls: list[float] = []

    def evaluate(_cfg: object, _checkpoint: object, _split: Split) -> EvalReport:
        calls.append(success := 0.1 * (len(calls) + 1))
        return _report(success)

    checkpoint = tmp_path / "run" / "step-000002"
    checkpoint.mkdir(parents=True)
    path = tmp_path / "evals" / "seed0.json"

    def rate(weights: str | None) -> float:
        got = cached_evaluation(evaluate, cfg, checkpoint, Split.TEST, path, None, weights)
        return got.success_rate

    assert rate("first weights") == pytest.approx(0.1)
    assert rate("first weights") == pytest.approx(0.1) and len(calls) == 1  # cached
    assert rate("retrained weights") == pytest.approx(0.2) and len(calls) == 2
    assert rate(None) == pytest.approx(0.3) and len(calls) == 3  # digest not known: its own key


def test_two_train_processes_share_a_grid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run another --train holds (its claim) is skipped, not trained twice or failed on."""
    from atgrpo.cli import main
    from atgrpo.experiments.compare import planned_runs
    from atgrpo.experiments.runs import RunStatus, claimed, grid_status, train_grid

    path = _grid_file(tmp_path, seeds=[0, 1])
    comparison = load_comparison(path)
    first, second = planned_runs(comparison)
    seen: list[tuple[int, str]] = []

    def note(status: RunStatus, what: str) -> None:
        seen.append((status.spec.seed, what if what in ("busy", "start") else "trained"))

    with claimed(first) as mine:
        assert mine
        with claimed(first) as again:
            assert not again  # one holder at a time (flock is per open file)
        train_grid(comparison, note)
        assert main(["compare", str(path), "--train"]) == 0  # seed 1 done; seed 0 is busy
        assert "the table waits for the runs other --train processes" in capsys.readouterr().out
        assert not (tmp_path / "grid" / "table.md").exists()
        assert main(["compare", str(path), "--status"]) == 0
        assert "seed 0" in (line := capsys.readouterr().out.splitlines()[0])
        assert line.startswith("missing") and line.endswith(", training now)")
    assert seen == [(0, "busy"), (1, "start"), (1, "trained")]
    assert [s.state for s in grid_status(comparison)] == ["missing", "done"]
    assert second.run_dir.is_dir() and not first.run_dir.exists()


def test_asking_a_grid_s_status_leaves_nothing_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--status only looks: it takes no claim file and makes no folder (a held claim still
    reads as "training now", test_two_train_processes_share_a_grid)."""
    from atgrpo.cli import main

    path = _grid_file(tmp_path, seeds=[0, 1])
    before = sorted(tmp_path.rglob("*"))
    assert main(["compare", str(path), "--status"]) == 0
    assert capsys.readouterr().out.count("missing") == 2
    assert sorted(tmp_path.rglob("*")) == before
