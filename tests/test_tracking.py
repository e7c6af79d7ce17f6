"""Trackers, step diagnostics, samples.jsonl and eval-<split>.json (docs/outputs.md)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from atgrpo.algo.advantage import Grouping, assign_advantages
from atgrpo.algo.records import Sample
from atgrpo.config import Config, ConfigError, load_config
from atgrpo.training.loop import TrainResult, train
from atgrpo.training.metrics import BranchRef, group_metrics, read_metrics, sample_parents
from atgrpo.training.tracking import ConsoleLogger, build_loggers
from conftest import REPO
from helpers import adv_settings

TINY = REPO / "configs" / "tiny.yaml"
FAST = ("rollout.max_prompt_tokens=2048", "rollout.max_new_tokens=8")


def _cfg(root: Path, name: str, *extra: str) -> Config:
    return load_config(TINY, [f"run.output_dir={root}", f"run.name={name}", *FAST, *extra])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> TrainResult:
    """Two steps of the tiny config into JSONL and TensorBoard, every task's samples logged."""
    cfg = _cfg(
        tmp_path_factory.mktemp("runs"),
        "tracked",
        "run.loggers=[jsonl,tensorboard]",
        "run.log_samples=2",
        "algo.entropy_coef=0.01",
    )
    return train(cfg)


def test_tensorboard_events_hold_the_jsonl_scalars(tiny_run: TrainResult) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = read_metrics(tiny_run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    acc = EventAccumulator(str(tiny_run.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    names = {k for r in records for k in r if k != "step"}
    assert set(acc.Tags()["scalars"]) == names
    for name in names:
        logged = {e.step: e.value for e in acc.Scalars(name)}
        expected = {r["step"]: r[name] for r in records if name in r}
        assert logged.keys() == expected.keys(), name
        for step, value in expected.items():
            if value is None:  # non-finite: null in JSONL, the float itself in TensorBoard
                assert not math.isfinite(logged[step]), name
            else:  # TensorBoard keeps float32
                assert math.isclose(logged[step], value, rel_tol=1e-6, abs_tol=1e-6), name


def test_step_metrics_name_every_diagnostic(tiny_run: TrainResult) -> None:
    first = tiny_run.history[0]
    for agent in ("tool", "planner"):
        for turn in (0, 1):
            for stat in ("count", "mean_size", "zero_std_frac", "mean_abs_adv", "valid"):
                assert f"groups/{agent}/t{turn}/{stat}" in first
            assert first[f"groups/{agent}/t{turn}/count"] == 2.0  # B = 2 tasks
            assert first[f"groups/{agent}/t{turn}/mean_size"] == 4.0  # K = 4
    for stat in ("loss", "clip_frac", "kl", "entropy", "grad_norm", "skipped"):
        assert f"loss/{stat}" in first
    stages = ("rollout", "programs", "update", "sync", "eval", "checkpoint", "step")
    for stage in stages:
        assert first[f"perf/{stage}_s"] >= 0.0
    assert first["perf/programs_s"] <= first["perf/rollout_s"] <= first["perf/step_s"]
    assert first["perf/lr"] > 0.0 and first["perf/tokens_per_s"] > 0.0


def _check_types(record: dict[str, Any]) -> None:
    types: dict[str, Any] = {
        "schema": int,
        "step": int,
        "task_id": int,
        "seed": int,
        "instance_key": (str, type(None)),
        "agent_id": str,
        "turn_idx": int,
        "branch_idx": int,
        "policy_id": str,
        "group": dict,
        "parent": (dict, type(None)),
        "kept": bool,
        "valid": bool,
        "team_reward": float,
        "local_reward": float,
        "reward": float,
        "advantage": float,
        "prompt": str,
        "response": str,
        "prompt_tokens": int,
        "response_tokens": int,
        "truncated": bool,
        "info": dict,
    }
    assert set(record) == set(types)
    for key, kind in types.items():
        value = record[key]
        if kind is float:
            assert isinstance(value, (int, float)) and not isinstance(value, bool), key
        else:
            assert isinstance(value, kind), key
    assert record["schema"] == 1
    assert set(record["group"]) == {"task_id", "agent_id", "turn_idx"}
    if record["parent"] is not None:
        assert set(record["parent"]) == {"agent_id", "turn_idx", "branch_idx"}


def test_samples_jsonl_follows_the_schema(tiny_run: TrainResult) -> None:
    lines = (tiny_run.run_dir / "samples.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    assert len(records) == 2 * 32  # 2 steps x (2 tasks x 2 turns x 2 agents x K = 4)
    kept = {
        (r["step"], r["task_id"], r["agent_id"], r["turn_idx"], r["branch_idx"])
        for r in records
        if r["kept"]
    }
    firsts = 0
    for r in records:
        _check_types(r)
        # agent_turn grouping: the group is the sample's own (task, agent, turn).
        assert r["group"] == {k: r[k] for k in ("task_id", "agent_id", "turn_idx")}
        assert r["prompt"].startswith("system: ") and "\nuser: " in r["prompt"]
        assert r["prompt_tokens"] > 0 and r["response_tokens"] >= 1
        assert r["instance_key"]
        parent = r["parent"]
        if parent is None:
            firsts += 1
            assert (r["agent_id"], r["turn_idx"]) == ("tool", 0)  # the episode's first action
        else:
            ref = (r["step"], r["task_id"], parent["agent_id"], parent["turn_idx"])
            assert (*ref, parent["branch_idx"]) in kept  # a kept branch of the same step, task
            assert (parent["agent_id"], parent["turn_idx"]) != (r["agent_id"], r["turn_idx"])
    assert firsts == 2 * 2 * 4  # the tool's K samples at turn 0 of each task, each step
    one_per_group = {(r["step"], r["task_id"], r["agent_id"], r["turn_idx"]) for r in records}
    assert len(kept) == len(one_per_group)


def _sample(
    task: int,
    agent: str,
    turn: int,
    branch: int,
    reward: float,
    *,
    valid: bool = True,
    tokens: int = 2,
    kept: bool = False,
) -> Sample:
    return Sample(
        task_id=task,
        seed=100 + task,
        agent_id=agent,
        turn_idx=turn,
        branch_idx=branch,
        policy_id="shared",
        prompt_ids=[1, 2, 3],
        response_ids=[7] * tokens,
        logprobs=[-1.0] * tokens,
        team_reward=0.0,
        local_reward=reward,
        reward=reward,
        valid=valid,
        kept=kept,
    )


def test_group_diagnostics_by_hand() -> None:
    samples = [
        # task 0: the tool's two branches differ; the planner's tie
        _sample(0, "tool", 0, 0, 1.0, tokens=4),
        _sample(0, "tool", 0, 1, 0.0, valid=False, tokens=2),
        _sample(0, "planner", 0, 0, 0.5),
        _sample(0, "planner", 0, 1, 0.5),
        # task 1: the tool ties
        _sample(1, "tool", 0, 0, 0.2, tokens=6),
        _sample(1, "tool", 0, 1, 0.2, valid=False, tokens=4),
    ]
    assign_advantages(samples, adv_settings(Grouping.AGENT_TURN))
    # rewards (1, 0): mean 0.5, population std 0.5, so A = +-0.5 / (0.5 + 1e-6)
    a = 0.5 / (0.5 + 1e-6)
    m = group_metrics(samples, Grouping.AGENT_TURN)
    assert m["groups/tool/t0/count"] == 2.0
    assert m["groups/tool/t0/mean_size"] == 2.0
    assert m["groups/tool/t0/zero_std_frac"] == 0.5
    assert m["groups/tool/t0/mean_abs_adv"] == pytest.approx(2 * a / 4)
    assert m["groups/tool/t0/valid"] == 0.5
    assert m["groups/tool/t0/response_tokens"] == 4.0
    assert m["groups/planner/t0/count"] == 1.0
    assert m["groups/planner/t0/zero_std_frac"] == 1.0
    assert m["groups/planner/t0/mean_abs_adv"] == 0.0
    assert m["groups/planner/t0/response_tokens"] == 2.0
    assert len(m) == 2 * 6

    # Pooled by task (turn grouping): task 0's tool and planner share one group of 4 samples.
    assign_advantages(samples, adv_settings(Grouping.TURN))
    pooled = group_metrics(samples, Grouping.TURN)
    assert pooled["groups/tool/t0/count"] == 2.0
    assert pooled["groups/tool/t0/mean_size"] == (4 + 2) / 2
    assert pooled["groups/tool/t0/zero_std_frac"] == 0.5
    assert pooled["groups/planner/t0/count"] == 1.0
    assert pooled["groups/planner/t0/mean_size"] == 4.0
    assert pooled["groups/planner/t0/zero_std_frac"] == 0.0


def test_trajectory_groups_count_trajectories() -> None:
    # Two trajectories of one task, two steps each: one group of 2 units at every (agent, turn).
    samples = [_sample(0, "planner", t, k, float(k), kept=True) for t in range(2) for k in range(2)]
    samples.sort(key=lambda s: s.branch_idx)  # trajectory by trajectory, as independent mode
    assign_advantages(samples, adv_settings(Grouping.TRAJECTORY))
    m = group_metrics(samples, Grouping.TRAJECTORY)
    for turn in (0, 1):
        assert m[f"groups/planner/t{turn}/count"] == 1.0
        assert m[f"groups/planner/t{turn}/mean_size"] == 2.0
        assert m[f"groups/planner/t{turn}/zero_std_frac"] == 0.0


def test_parents_tree_and_independent() -> None:
    tree = [
        _sample(0, "tool", 0, 0, 0.0),
        _sample(0, "tool", 0, 1, 1.0, kept=True),
        _sample(1, "tool", 0, 0, 0.0, kept=True),
        _sample(1, "tool", 0, 1, 0.0),
        _sample(0, "planner", 0, 0, 0.0, kept=True),
        _sample(0, "planner", 0, 1, 0.0),
        _sample(0, "tool", 1, 0, 0.0, kept=True),
    ]
    assert sample_parents(tree, tree=True) == [
        None,
        None,
        None,
        None,
        BranchRef("tool", 0, 1),
        BranchRef("tool", 0, 1),
        BranchRef("planner", 0, 0),
    ]
    # Independent: K = 2 trajectories of one task, interleaved step by step; width 1, all kept.
    independent = [
        _sample(0, a, t, k, 0.0, kept=True)
        for t in range(2)
        for a in ("tool", "planner")
        for k in range(2)
    ]
    parents = sample_parents(independent, tree=False)
    for s, parent in zip(independent, parents, strict=True):
        if (s.agent_id, s.turn_idx) == ("tool", 0):
            assert parent is None
        else:
            assert parent is not None and parent.branch_idx == s.branch_idx  # its own trajectory
            previous = ("tool", s.turn_idx) if s.agent_id == "planner" else ("planner", 0)
            assert (parent.agent_id, parent.turn_idx) == previous


def test_wandb_offline_run_writes_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, "wb", "run.loggers=[wandb]", "train.steps=1", "checkpoint.every=0")
    train(cfg)
    runs = list((cfg.run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data = list(runs[0].glob("run-*.wandb"))
    assert data and data[0].stat().st_size > 0
    assert not (cfg.run_dir / "metrics.jsonl").exists()  # jsonl was not asked for


def test_missing_wandb_is_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = _cfg(tmp_path, "nowb", "run.loggers=[jsonl,wandb]")
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[wandb\]"') as err:
        build_loggers(cfg)
    assert "\n" not in str(err.value)


def test_console_logger_prints_training_steps_only() -> None:
    lines: list[str] = []
    logger = ConsoleLogger(3, write=lines.append)
    logger.log(0, {"test/success": 0.5})  # an evaluation record: the caller reports it
    logger.log(1, {"reward/tool/mean": 0.25, "rollout/success": 1.0, "perf/step_s": 2.0})
    assert len(lines) == 1
    assert lines[0].startswith("step   1/3") and "tool +0.250" in lines[0]


def _check_eval_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert set(data) == {
        "schema",
        "split",
        "num_tasks",
        "samples_per_task",
        "success_rate",
        "mean_team_return",
        "pass_at",
        "valid_rate",
        "mean_reward",
        "note",
        "tasks",
        # what atgrpo eval measured (training.evaluation.measured)
        "checkpoint",
        "env",
        "models",
        "config_hash",
        "config",
    }
    assert data["schema"] == 1 and data["split"] == "test" and data["num_tasks"] == 2
    assert data["env"]["name"] == "plan_path" and data["config"]["env"] == data["env"]
    assert len(data["tasks"]) == 2
    for i, task in enumerate(data["tasks"]):
        assert set(task) == {
            "task_id",
            "seed",
            "instance_key",
            "successes",
            "episodes",
            "team_return",
        }
        assert task["task_id"] == i and isinstance(task["instance_key"], str)
        assert task["episodes"] == data["samples_per_task"] == 1
        assert 0 <= task["successes"] <= task["episodes"]
    solved = sum(t["successes"] for t in data["tasks"])
    assert data["success_rate"] == pytest.approx(solved / 2)
    returns = [t["team_return"] for t in data["tasks"]]
    assert data["mean_team_return"] == pytest.approx(sum(returns) / 2)
    return data


def test_cli_eval_writes_per_task_results_next_to_the_checkpoint(
    tiny_run: TrainResult, tmp_path: Path
) -> None:
    from atgrpo.cli import main

    assert tiny_run.checkpoint is not None
    run = tiny_run.run_dir
    args = [str(TINY), f"run.output_dir={run.parent}", f"run.name={run.name}", *FAST]
    assert main(["eval", *args, "--checkpoint", str(run), "--num-tasks", "2"]) == 0
    _check_eval_json(tiny_run.checkpoint / "eval-test.json")

    base = [str(TINY), f"run.output_dir={tmp_path}", "run.name=baseline", *FAST]
    assert main(["eval", *base, "--num-tasks", "2"]) == 0  # untrained: under the run folder
    _check_eval_json(tmp_path / "baseline" / "eval-test.json")


def test_the_step_line_says_when_an_update_was_skipped() -> None:
    from atgrpo.training.metrics import step_summary

    base = {"reward/planner/mean": 0.5, "rollout/success": 0.25, "perf/step_s": 1.5}
    taken = step_summary(3, 10, base | {"loss/loss": 0.0123, "loss/skipped": 0.0}, ("planner",))
    assert "loss +0.0123" in taken
    skipped = step_summary(3, 10, base | {"loss/loss": 0.0, "loss/skipped": 1.0}, ("planner",))
    assert "loss skipped" in skipped and "+0.0000" not in skipped
    two = base | {"loss/a/loss": 0.5, "loss/a/skipped": 0.0, "loss/b/loss": 0.0}
    two["loss/b/skipped"] = 1.0
    assert "loss a +0.5000  b skipped" in step_summary(3, 10, two, ("planner",))
