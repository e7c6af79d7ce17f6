"""The whole loop for a couple of steps on the tiny model: update, metrics, checkpoint, resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from atgrpo.algo.loss import LossAggregation
from atgrpo.algo.records import Sample
from atgrpo.algo.update import UpdateSettings, ppo_update
from atgrpo.config import load_config
from atgrpo.generation import SamplingParams
from atgrpo.models import build_tiny_model
from atgrpo.policies import build_policy
from atgrpo.training.loop import train
from conftest import REPO
from helpers import UPDATE_DEFAULTS

TINY = REPO / "configs" / "tiny.yaml"
# Shorter prompts and answers than tiny.yaml: the same code paths, a few seconds per run.
FAST = ("rollout.max_prompt_tokens=2048", "rollout.max_new_tokens=8")


def _cfg(tmp_path: Path, name: str, *extra: str):
    # The tiny random model rarely writes a valid action, so most groups have equal rewards;
    # an entropy bonus and keeping zero-advantage samples make every step move the weights.
    return load_config(
        TINY,
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "algo.entropy_coef=0.01",
            "algo.skip_zero_advantage=false",
            *FAST,
            *extra,
        ],
    )


def _params(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_two_steps_train_write_metrics_and_checkpoint_then_resume(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "smoke")
    result = train(cfg)
    assert result.steps_done == 2
    lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    first = json.loads(lines[0])
    assert "reward/tool/mean" in first and "reward/planner/mean" in first
    assert first["loss/skipped"] == 0.0
    assert first["groups/planner/t0/count"] == 2.0  # one group per task (docs/outputs.md)
    assert first["perf/step_s"] >= first["perf/rollout_s"] >= first["perf/programs_s"] > 0.0
    ckpt = cfg.run_dir / "checkpoints" / "step-000002"
    assert (ckpt / "policy-shared" / "model.safetensors").is_file()
    assert (ckpt / "policy-shared" / "optim.pt").is_file()
    assert (cfg.run_dir / "checkpoints" / "latest").read_text().strip() == "step-000002"

    initial, _ = build_tiny_model(seed=0)
    trained = _params(ckpt / "policy-shared")
    changed = [
        k
        for k, v in initial.state_dict().items()
        if k in trained and not torch.equal(v, trained[k])
    ]
    assert changed, "no parameter changed after two training steps"

    more = _cfg(tmp_path, "smoke", "train.steps=3")
    resumed = train(more, resume=True)
    assert resumed.steps_done == 3
    steps = [
        json.loads(x)["step"] for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3]


def _weights(policy_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    adapter = policy_dir / "adapter_model.safetensors"
    return load_file(str(adapter if adapter.is_file() else policy_dir / "model.safetensors"))


def _assert_same(a: object, b: object, where: str) -> None:
    """Tensors bit-identical, everything else equal, recursively (optimizer and RNG states)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "shape"):  # numpy arrays in the RNG state
        assert (a == b).all(), where  # type: ignore[union-attr]
    else:
        assert a == b, where


@pytest.mark.parametrize(
    ("config", "policies"),
    [
        ("tiny.yaml", ["shared"]),  # L1
        ("tiny-lora.yaml", ["tool", "planner"]),  # L2: adapters alone in the checkpoint
        ("tiny-per_role.yaml", ["tool", "planner"]),  # L3
    ],
)
def test_resume_reaches_the_same_parameters_as_an_uninterrupted_run(
    tmp_path: Path, config: str, policies: list[str]
) -> None:
    def cfg(name: str, *extra: str):
        return load_config(
            REPO / "configs" / config,
            [
                f"run.output_dir={tmp_path}",
                f"run.name={name}",
                "algo.entropy_coef=0.01",
                "algo.skip_zero_advantage=false",
                *FAST,
                *extra,
            ],
        )

    straight = train(cfg("straight"))
    train(cfg("split", "train.steps=1"))
    resumed = train(cfg("split"), resume=True)
    assert straight.checkpoint is not None and resumed.checkpoint is not None
    first = tmp_path / "straight" / "checkpoints" / "step-000001"
    for pid in policies:
        a_dir, b_dir = straight.checkpoint / f"policy-{pid}", resumed.checkpoint / f"policy-{pid}"
        if config == "tiny-lora.yaml":
            assert not (a_dir / "model.safetensors").exists()  # the base is never copied
        a, b = _weights(a_dir), _weights(b_dir)
        _assert_same(a, b, f"{pid} weights")
        moved = _weights(first / f"policy-{pid}")
        assert any(not torch.equal(a[k], moved[k]) for k in a), f"{pid} did not train in step 2"
        _assert_same(
            torch.load(a_dir / "optim.pt", weights_only=False),
            torch.load(b_dir / "optim.pt", weights_only=False),
            f"{pid} optimizer",
        )
    _assert_same(
        torch.load(straight.checkpoint / "rng.pt", weights_only=False),
        torch.load(resumed.checkpoint / "rng.pt", weights_only=False),
        "rng",
    )


def _samples(policy, advantage: float, n: int = 4) -> list[Sample]:
    tok = policy.tokenizer
    prompt = tok("Moves?", add_special_tokens=False)["input_ids"]
    gens = []
    from atgrpo.generation import HFGenerator

    torch.manual_seed(0)
    gens = HFGenerator(policy.model, tok, share_prefill=True).generate(
        [prompt] * n, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0)
    )
    return [
        Sample(
            0,
            0,
            "planner",
            0,
            k,
            "shared",
            prompt,
            g.token_ids,
            g.logprobs,
            0.0,
            0.0,
            0.0,
            True,
            advantage=advantage if k % 2 else -advantage,
        )
        for k, g in enumerate(gens)
    ]


def _settings() -> UpdateSettings:
    return UpdateSettings(
        1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.0, 2, 1.0, **UPDATE_DEFAULTS
    )


def test_tiny_config_as_shipped_changes_the_weights(tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "run.name=shipped"])
    before = {k: v.clone() for k, v in build_policy(cfg).model.state_dict().items()}
    result = train(cfg)
    assert any(m["loss/skipped"] == 0.0 for m in result.history)
    assert any(m["rollout/adv_zero_std_frac"] < 1.0 for m in result.history)
    after = _params(result.checkpoint / "policy-shared")
    assert any(not torch.equal(before[k], after[k]) for k in after)


def test_first_update_has_ratio_one_and_changes_weights(tmp_path: Path) -> None:
    policy = build_policy(_cfg(tmp_path, "unit"))
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    stats = ppo_update(policy, _samples(policy, 1.0), _settings())
    assert not stats.skipped
    assert math.isclose(stats.ratio_mean, 1.0, abs_tol=1e-4)
    assert stats.clip_frac == 0.0
    after = policy.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_nan_loss_skips_the_update_and_keeps_the_weights(tmp_path: Path) -> None:
    policy = build_policy(_cfg(tmp_path, "nan"))
    samples = _samples(policy, 1.0)
    samples[0].advantage = float("nan")
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    stats = ppo_update(policy, samples, _settings())
    assert stats.skipped and "non-finite" in stats.reason
    after = policy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_cli_trains_and_evaluates_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from atgrpo.cli import main

    args = [str(TINY), f"run.output_dir={tmp_path}", "run.name=cli", "train.steps=1", *FAST]
    assert main(["train", *args]) == 0
    assert (tmp_path / "cli" / "samples.jsonl").is_file()
    assert main(["eval", *args, "--checkpoint", str(tmp_path / "cli"), "--num-tasks", "2"]) == 0
    results = tmp_path / "cli" / "checkpoints" / "step-000001" / "eval-test.json"
    assert json.loads(results.read_text())["num_tasks"] == 2  # next to the checkpoint
    out = capsys.readouterr().out
    assert "step   1/1" in out
    assert "success" in out and "on 2 test tasks" in out
    # A second run into the same folder without --resume is refused, not overwritten.
    assert main(["train", *args]) == 2
    assert "--resume" in capsys.readouterr().err


def test_callbacks_see_every_step_and_the_test_evaluations(tmp_path: Path) -> None:
    from atgrpo import TrainCallback

    seen: list[tuple[str, int, object]] = []

    class Record(TrainCallback):
        def on_step(self, step: int, metrics: dict[str, float]) -> None:
            seen.append(("step", step, metrics["rollout/success"]))

        def on_eval(self, step: int, split: str, report: object) -> None:
            seen.append((f"eval {split}", step, report))

    cfg = _cfg(
        tmp_path, "hooks", "eval.before_training=true", "eval.after_training=true",
        "eval.num_tasks=1",
    )  # fmt: skip
    steps: list[int] = []
    result = train(cfg, on_step=lambda step, _: steps.append(step), callbacks=[Record()])
    assert [(kind, step) for kind, step, _ in seen] == [
        ("eval test", 0), ("step", 1), ("step", 2), ("eval test", 2),
    ]  # fmt: skip
    assert seen[0][2] is result.eval_before and seen[-1][2] is result.eval_after
    assert steps == [1, 2]  # on_step still works beside the callbacks
