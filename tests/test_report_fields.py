"""What the report shows of a run beyond its curves (issue 25, item 5): the tool's program
output and why an answer was invalid, answers cut at max_new_tokens, a kept branch chosen by
tie-break, and test success before -> after from ``atgrpo eval``'s files.

``write_fields_run`` is also the browser tests' run with these fields (test_report_browser.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from atgrpo.config import load_config
from atgrpo.report import load_run, write_report
from atgrpo.report.html import _before_after, cut_rates
from atgrpo.report.rollouts import rollout_payload
from atgrpo.training.loop import train
from atgrpo.training.metrics import INFO_MAX_CHARS, step_info

REPO = Path(__file__).resolve().parents[1]

CONFIG = """run: {{name: {name}}}
env: {{name: math, workflow: mas}}
model: {{path: tiny-random-llama}}
train: {{steps: 2}}
rollout: {{num_tasks: 1, num_generations: 3, sampling: tree}}
algo: {{alpha: 1.0}}
"""

STDOUT = "65 + 22 * 59 = 1363"  # what the kept tool program printed


def _sample(step: int, agent: str, branch: int, reward: float, **extra: Any) -> dict[str, Any]:
    return {
        "schema": 1,
        "step": step,
        "task_id": 0,
        "seed": 7,
        "instance_key": "math:7",
        "agent_id": agent,
        "turn_idx": 0,
        "branch_idx": branch,
        "policy_id": "shared",
        "group": {"task_id": 0, "agent_id": agent, "turn_idx": 0},
        "parent": None if agent == "tool" else {"agent_id": "tool", "turn_idx": 0, "branch_idx": 0},
        "kept": branch == 0,
        "valid": reward > 0,
        "team_reward": reward,
        "local_reward": 0.0,
        "reward": reward,
        "advantage": 0.0,
        "prompt": f"user: {agent} prompt",
        "response": f"{agent} answer {branch}",
        "prompt_tokens": 10,
        "response_tokens": 8,
        **extra,
    }


def _step_samples(step: int) -> list[dict[str, Any]]:
    tool = [
        # Two programs printed the answer (rewards tie: branch 0 kept by tie-break) ...
        _sample(step, "tool", 0, 1.0, truncated=False, info=_tool_info("ok", STDOUT, None)),
        _sample(step, "tool", 1, 1.0, truncated=False, info=_tool_info("ok", STDOUT, None)),
        # ... one failed, cut at max_new_tokens.
        _sample(
            step,
            "tool",
            2,
            0.0,
            truncated=True,
            info={**_tool_info("error", "", "program failed (error)"), "error": "ZeroDivision"},
        ),
    ]
    reasoner = [
        _sample(step, "reasoner", 0, 1.0, truncated=False, info={"parse_error": None}),
        _sample(step, "reasoner", 1, 0.5, truncated=False, info={"parse_error": None}),
        _sample(
            step, "reasoner", 2, 0.0, truncated=False, info={"parse_error": "no \\boxed{} answer"}
        ),
    ]
    return tool + reasoner


def _tool_info(status: str, stdout: str, parse_error: str | None) -> dict[str, Any]:
    return {"parse_error": parse_error, "program_status": status, "stdout": stdout}


def write_fields_run(root: Path, name: str = "fields") -> Path:
    """A finished run with the new samples.jsonl fields, no test/ metrics, and the test
    evaluations ``atgrpo eval`` wrote: the untrained model (run folder) and step 2."""
    run = root / name
    ckpt = run / "checkpoints" / "step-000002"
    ckpt.mkdir(parents=True)
    (run / "config.yaml").write_text(CONFIG.format(name=name))
    metrics = [
        {"step": s, "reward/tool/mean": 0.6, "reward/reasoner/mean": 0.5, "rollout/success": 0.5}
        for s in (1, 2)
    ]
    for row, cut in zip(metrics, (0.5, 1.0 / 3), strict=True):
        row.update({"rollout/tool/truncated_frac": cut, "rollout/reasoner/truncated_frac": 0.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    lines = [json.dumps(s) for step in (1, 2) for s in _step_samples(step)]
    (run / "samples.jsonl").write_text("\n".join(lines) + "\n")
    for folder, rate in ((run, 0.25), (ckpt, 0.625)):
        record = {"schema": 1, "split": "test", "num_tasks": 8, "success_rate": rate}
        (folder / "eval-test.json").write_text(json.dumps(record))
    # Another split and an evaluation of another config are not the run's test success.
    other = {"schema": 1, "split": "test", "num_tasks": 8, "success_rate": 0.0}
    (ckpt / "eval-test-3f9c21ab.json").write_text(json.dumps(other))
    (ckpt / "eval-validation.json").write_text(json.dumps({**other, "split": "validation"}))
    return run


@pytest.fixture(scope="module")
def fields_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fields_run(tmp_path_factory.mktemp("runs"))


def _nodes(run_dir: Path) -> list[dict[str, Any]]:
    payload = rollout_payload([load_run(run_dir)])
    return payload["runs"][0]["steps"][0]["tasks"][0]["nodes"]


def test_tool_cards_carry_the_program_output_and_why_an_answer_was_invalid(
    fields_run: Path,
) -> None:
    tool, reasoner = _nodes(fields_run)
    kept = tool["branches"][0]
    assert kept["info"] == _tool_info("ok", STDOUT, None)
    failed = tool["branches"][2]["info"]
    assert failed["parse_error"] == "program failed (error)"
    assert failed["error"] == "ZeroDivision"
    assert reasoner["branches"][2]["info"]["parse_error"] == "no \\boxed{} answer"


def test_cut_answers_are_marked_per_card_and_as_a_rate_per_agent(fields_run: Path) -> None:
    tool, reasoner = _nodes(fields_run)
    assert [b["truncated"] for b in tool["branches"]] == [False, False, True]
    assert (tool["truncated"], reasoner["truncated"]) == (1, 0)
    assert cut_rates(load_run(fields_run)) == "tool 42% \u00b7 reasoner 0%"


def test_a_kept_branch_chosen_by_tie_break_is_marked(fields_run: Path) -> None:
    tool, reasoner = _nodes(fields_run)
    assert tool["tie"] == [0, 1]  # branches 0 and 1 share the best reward; 0 was kept
    assert reasoner["tie"] is None  # a clear winner


def test_before_after_comes_from_the_eval_files_when_the_run_logged_no_test_metrics(
    fields_run: Path,
) -> None:
    text = _before_after(load_run(fields_run))
    assert text == "25.0% \u2192 62.5% (atgrpo eval: untrained, step 2)"


def test_before_after_prefers_the_runs_own_test_metrics(fields_run: Path, tmp_path: Path) -> None:
    run = write_fields_run(tmp_path, "own")
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 0, "test/success": 0.125}) + "\n")
    # No after-training record: the checkpoint's eval-test.json fills the after side.
    assert _before_after(load_run(run)) == "12.5% \u2192 62.5% (atgrpo eval: step 2)"


def test_the_page_shows_the_new_fields(fields_run: Path, tmp_path: Path) -> None:
    page = write_report([fields_run], tmp_path / "report.html").read_text(encoding="utf-8")
    assert "25.0% \u2192 62.5%" in page
    assert "cut at max_new_tokens" in page
    assert 'id="hash-note"' in page


def test_older_samples_without_the_fields_still_report(tmp_path: Path) -> None:
    run = write_fields_run(tmp_path)
    lines = (run / "samples.jsonl").read_text().splitlines()
    stripped = []
    for line in lines:
        row = json.loads(line)
        row.pop("info"), row.pop("truncated")
        stripped.append(json.dumps(row))
    (run / "samples.jsonl").write_text("\n".join(stripped) + "\n")
    tool = _nodes(run)[0]
    assert tool["truncated"] is None and tool["branches"][0]["info"] is None
    write_report([run], tmp_path / "report.html")


def test_step_info_is_a_bounded_json_copy() -> None:
    info = {
        "agent_id": "tool",
        "stdout": "x" * (INFO_MAX_CHARS + 50),
        "plan_end": (1, 2),
        "score": float("nan"),
        "valid": True,
        **{f"k{i}": i for i in range(30)},
    }
    out = step_info(info)
    assert "agent_id" not in out and len(out) == 16
    assert out["stdout"].startswith("x" * INFO_MAX_CHARS) and "50 more characters" in out["stdout"]
    assert out["plan_end"] == "[1, 2]" and out["score"] is None and out["valid"] is True
    json.dumps(out, allow_nan=False)


def test_a_training_run_logs_the_tool_program_and_truncation(tmp_path: Path) -> None:
    cfg = load_config(
        REPO / "configs/tiny.yaml",
        [f"run.output_dir={tmp_path}", "run.name=t", "train.steps=1", "run.log_samples=1"],
    )
    run_dir = train(cfg).run_dir
    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    tool = [r for r in rows if r["agent_id"] == "tool"]
    assert tool and all(isinstance(r["truncated"], bool) for r in rows)
    for r in tool:
        assert {"program_status", "stdout", "parse_error"} <= set(r["info"])
        assert r["valid"] == (r["info"]["parse_error"] is None)
