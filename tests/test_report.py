"""``atgrpo report``: one offline HTML page with curves and the rollout viewer."""

from __future__ import annotations

import json
from collections import defaultdict
from html.parser import HTMLParser
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from atgrpo.cli import main
from atgrpo.config import load_config
from atgrpo.report import plots_of, write_report
from atgrpo.report.data import Parent, SampleRecord, load_run
from atgrpo.report.rollouts import branch_parents, embedded_steps, task_nodes
from atgrpo.training.loop import train

REPO = Path(__file__).resolve().parents[1]
AGENTS = ("tool", "planner")
K = 3  # branches per (task, agent, turn) in the hand-written runs
HOSTILE = "</script><script>alert(1)</script> see http://example.com"

CONFIG = """\
run:
  name: {name}
model:
  path: tiny-random-llama
env:
  name: plan_path
  workflow: mas
rollout:
  num_tasks: 2
  num_generations: 3
  sampling: tree
algo:
  alpha: 0.7
train:
  steps: 3
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real two-step run of the tiny config: whatever schema the trainer writes today."""
    out = tmp_path_factory.mktemp("runs")
    cfg = load_config(
        REPO / "configs/tiny.yaml", [f"run.output_dir={out}", "run.name=a", "train.steps=2"]
    )
    return train(cfg).run_dir


def _metrics_rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{"step": 0, "test/success": 0.25, "test/team_return": -0.5}]
    for step in (1, 2, 3):
        row: dict[str, Any] = {"step": step}
        for i, agent in enumerate(AGENTS):
            row[f"reward/{agent}/mean"] = -1.0 + 0.3 * step + 0.1 * i
            row[f"reward/{agent}/valid"] = min(1.0, 0.3 * step + 0.2 * i)
            row[f"rollout/{agent}/response_tokens"] = 10.0 + step
        row |= {
            "rollout/success": 0.25 * step,
            "rollout/team_return": 0.1 * step,
            "loss/loss": 0.01 * (-1) ** step,
            "loss/kl": 0.0,  # no KL term: named on the page, not drawn
            "loss/grad_norm": None if step == 2 else 1.5,  # a NaN the sink wrote as null
            "perf/lr": 1e-5,
            "perf/rollout_s": 2.0,
            "perf/update_s": 1.0,
            "perf/step_s": 3.0,
        }
        if step == 2:
            row["eval/success"] = 0.5
        rows.append(row)
    rows.append({"step": 3, "test/success": 0.5, "test/team_return": 0.25})
    return rows


def _sample(step: int, task: int, agent: str, turn: int, branch: int, kept: int) -> dict[str, Any]:
    return {
        "step": step,
        "task_id": task,
        "seed": 10 + task,
        "agent_id": agent,
        "turn_idx": turn,
        "branch_idx": branch,
        "kept": branch == kept,
        "valid": branch != 2,
        "team_reward": float(branch == kept),
        "local_reward": -0.5 * branch,
        "reward": 0.7 * float(branch == kept) - 0.15 * branch,
        "advantage": 1.0 if branch == kept else -0.5,
        "response": HOSTILE if (step, task, branch) == (1, 0, 0) else f"Moves: R{branch}",
    }


def _samples(schema: int) -> list[dict[str, Any]]:
    """Every (step, task, turn, agent) with K branches, one kept; the newer fields if schema 1."""
    out = []
    for step in (1, 2, 3):
        for task in (0, 1):
            parent = None
            for turn in (0, 1):
                for agent in AGENTS:
                    kept = (step + task + turn + len(agent)) % K
                    for branch in range(K):
                        s = _sample(step, task, agent, turn, branch, kept)
                        if schema:
                            s |= {
                                "schema": 1,
                                "instance_key": f"grid-{task}",
                                "policy_id": "shared",
                                "group": {"task_id": task, "agent_id": agent, "turn_idx": turn},
                                "parent": parent,
                                "prompt": f"state of task {task} before {agent} turn {turn}",
                                "prompt_tokens": 40,
                                "response_tokens": 3,
                            }
                        out.append(s)
                    parent = {"agent_id": agent, "turn_idx": turn, "branch_idx": kept}
    return out


def _write_run(root: Path, name: str, schema: int) -> Path:
    run = root / name
    (run / "checkpoints" / "step-000003").mkdir(parents=True)
    (run / "config.yaml").write_text(CONFIG.format(name=name))
    lines = [json.dumps(r) for r in _metrics_rows()]
    # A run still writing: its last line is half there.
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "reward/to')
    samples = "\n".join(json.dumps(s) for s in _samples(schema)) + "\n"
    (run / "samples.jsonl").write_text(samples)
    record = {"schema": 1, "split": "test", "num_tasks": 4, "success_rate": 0.5}
    (run / "checkpoints" / "step-000003" / "eval-test.json").write_text(json.dumps(record))
    return run


@pytest.fixture(scope="module")
def old_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_run(tmp_path_factory.mktemp("old"), "old", schema=0)


@pytest.fixture(scope="module")
def new_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_run(tmp_path_factory.mktemp("new"), "new", schema=1)


@pytest.fixture(scope="module")
def page(tiny_run: Path, old_run: Path, new_run: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("report") / "report.html"
    assert main(["report", str(tiny_run), str(old_run), str(new_run), "--out", str(out)]) == 0
    return out.read_text(encoding="utf-8")


class _Page(HTMLParser):
    """Every src / href, the text outside the JSON data block, the images, the JSON block."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.outside_json: list[str] = []
        self.images: list[dict[str, str | None]] = []
        self.figures: dict[str, list[str]] = {}
        self.json_blocks: dict[str, str] = {}
        self._in_json: str | None = None
        self._figure: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.links += [v or "" for k, v in attrs if k in ("src", "href")]
        self.outside_json += [v or "" for _, v in attrs]
        if tag == "script" and a.get("type") == "application/json":
            self._in_json = a.get("id") or ""
            self.json_blocks[self._in_json] = ""
        if tag == "figure":
            self._figure = a.get("id")
            self.figures[self._figure or ""] = json.loads(a.get("data-series") or "[]")
        if tag == "img":
            self.images.append({**a, "figure": self._figure})

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_json = None
        if tag == "figure":
            self._figure = None

    def handle_data(self, data: str) -> None:
        if self._in_json is not None:
            self.json_blocks[self._in_json] += data
        else:
            self.outside_json.append(data)


def _parse(html: str) -> _Page:
    parsed = _Page()
    parsed.feed(html)
    parsed.close()
    return parsed


def test_the_page_refers_to_nothing_outside_itself(page: str) -> None:
    parsed = _parse(page)
    assert parsed.links, "the page has no src/href at all: the parser missed them"
    for link in parsed.links:
        assert link.startswith(("data:", "#")), link
    text = "\n".join(parsed.outside_json)
    assert "http://" not in text and "https://" not in text
    assert "@import" not in page and "<link" not in page
    # A response that tries to close the JSON block stays inside it, as data.
    assert HOSTILE not in page
    assert "alert(1)" in parsed.json_blocks["rollouts"]


def test_one_image_per_curve_with_every_agent_in_its_legend(
    page: str, tiny_run: Path, old_run: Path
) -> None:
    figures = plots_of([tiny_run, old_run])
    keys = [p.key for p in figures.plots]
    for expected in ("reward", "valid", "success", "loss", "lr", "timings", "tokens"):
        assert expected in keys
    assert "KL to the reference" not in [p.title for p in figures.plots]
    for plot in figures.plots:
        if plot.key in ("reward", "valid", "tokens"):
            for run in ("a", "old"):
                for agent in AGENTS:
                    assert f"{run} · {agent}" in plot.labels, (plot.key, plot.labels)
        assert plot.png.startswith(b"\x89PNG")
    success = next(p for p in figures.plots if p.key == "success")
    assert "old · validation" in success.labels and "old · test" in success.labels

    parsed = _parse(page)
    on_page = {img["figure"] for img in parsed.images}
    assert len(parsed.images) == len(on_page)  # one image per figure
    assert {f"fig-{key}" for key in keys} == on_page
    assert all(str(i["src"]).startswith("data:image/png;base64,") for i in parsed.images)
    for agent in AGENTS:  # the legend entries ride along on the page, three runs now
        assert f"new · {agent}" in parsed.figures["fig-reward"]
    assert "Zero at every step" in page and "KL to the reference" in page


def _logged(run: Path) -> dict[tuple[int, int], list[dict[str, Any]]]:
    by_task: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for line in (run / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        by_task[(s["step"], s["task_id"])].append(s)
    return by_task


def test_the_rollout_json_holds_every_branch_of_every_agent_and_turn(
    page: str, tiny_run: Path, old_run: Path, new_run: Path
) -> None:
    payload = json.loads(_parse(page).json_blocks["rollouts"])
    runs = {r["name"]: r for r in payload["runs"]}
    assert set(runs) == {"a", "old", "new"}
    for name, folder, k in (("a", tiny_run, 4), ("old", old_run, K), ("new", new_run, K)):
        logged = _logged(folder)
        shown = runs[name]
        assert {s["step"] for s in shown["steps"]} == {step for step, _ in logged}
        for step in shown["steps"]:
            for task in step["tasks"]:
                samples = logged[(step["step"], task["task_id"])]
                expected = {(s["agent_id"], s["turn_idx"]) for s in samples}
                nodes = task["nodes"]
                assert {(n["agent_id"], n["turn_idx"]) for n in nodes} == expected
                for node in nodes:
                    assert len(node["branches"]) == k
                    assert sum(b["kept"] for b in node["branches"]) == 1
                _check_kept_path(nodes)
    new_node = runs["new"]["steps"][0]["tasks"][0]["nodes"][1]
    assert new_node["prompt"].startswith("state of task 0")  # shared by the K branches, once
    assert new_node["group"] == [0, "planner", 0] and new_node["policy_id"] == "shared"
    assert runs["old"]["schema"] == 0 and runs["new"]["schema"] == 1


def _check_kept_path(nodes: list[dict[str, Any]]) -> None:
    """Every branch acted on the previous action's kept branch; the first ones on nothing."""
    assert all(b["parent"] is None for b in nodes[0]["branches"])
    for prev, node in pairwise(nodes):
        kept = next(b["branch_idx"] for b in prev["branches"] if b["kept"])
        for b in node["branches"]:
            assert b["parent"] == [prev["agent_id"], prev["turn_idx"], kept]


def test_a_logged_parent_wins_over_the_derived_one() -> None:
    def rec(agent: str, turn: int, branch: int, kept: bool, **kw: Any) -> SampleRecord:
        return SampleRecord(1, 0, 0, agent, turn, branch, kept, True, 0, 0, 0, 0, "", **kw)

    odd = Parent("tool", 0, 1)  # not the kept branch: a logged link is taken as it is
    nodes = task_nodes(
        [
            rec("planner", 0, 0, True, parent=odd, parent_logged=True),
            rec("tool", 0, 0, True, parent=None, parent_logged=True),
            rec("tool", 0, 1, False, parent=None, parent_logged=True),
        ],
        ["tool", "planner"],
    )
    assert [(n.agent_id, n.turn_idx) for n in nodes] == [("tool", 0), ("planner", 0)]
    assert branch_parents(nodes)[("planner", 0, 0)] == odd


def test_long_runs_embed_a_bounded_spread_of_steps(old_run: Path, tmp_path: Path) -> None:
    chosen = embedded_steps(list(range(1, 1001)), 200)
    assert len(chosen) == 200 and chosen[0] == 1 and chosen[-1] == 1000
    assert chosen == sorted(set(chosen))
    assert embedded_steps([1, 2, 3], 200) == [1, 2, 3]
    out = write_report([old_run], tmp_path / "r.html", max_steps=2)
    page = out.read_text()
    payload = json.loads(_parse(page).json_blocks["rollouts"])
    assert [s["step"] for s in payload["runs"][0]["steps"]] == [1, 3]
    assert "holds 2 of 3 logged steps" in page


def test_old_runs_load_leniently(old_run: Path) -> None:
    run = load_run(old_run)
    assert run.skipped_lines == 1  # the half-written metrics line
    assert run.agents == list(AGENTS)
    assert run.series("loss/grad_norm") == ([1, 3], [1.5, 1.5])  # the null is a gap
    assert run.series("test/success") == ([0, 3], [0.25, 0.5])
    assert run.samples[0].prompt is None and not run.samples[0].parent_logged
    assert [(e.step, e.split, e.values["success_rate"]) for e in run.evals] == [(3, "test", 0.5)]


def test_the_default_output_is_in_the_first_run(old_run: Path, capsys) -> None:
    assert main(["report", str(old_run)]) == 0
    assert (old_run / "report.html").is_file()
    assert str(old_run / "report.html") in capsys.readouterr().out


def test_a_missing_run_or_one_without_metrics_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metrics.jsonl" in err
