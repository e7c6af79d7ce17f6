"""vLLM beside the trainer: every rollout engine sleeps before each update and wakes before its
new weights are synced and before the next rollout (vLLM's sleep mode needs CUDA's allocator,
which the CPU build lacks, so here the calling order around the update is what is tested, on
the training loop itself, with recording engines around the real ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from atgrpo import train
from atgrpo.config import ConfigError, load_config
from atgrpo.policies import sleep_engine
from atgrpo.training import runtime as runtime_module
from conftest import REPO

TINY = REPO / "configs" / "tiny.yaml"


class Recording:
    """A rollout engine's calls, logged by name into a shared list."""

    def __init__(self, inner: Any, log: list[str]) -> None:
        self.inner, self.log = inner, log

    def generate(self, prompts: list[list[int]], params: Any) -> Any:
        self.log.append("generate")
        return self.inner.generate(prompts, params)

    def sync_weights(self) -> None:
        self.log.append("sync")
        self.inner.sync_weights()

    def sleep(self) -> None:
        self.log.append("sleep")
        self.inner.sleep()

    def wake_up(self) -> None:
        self.log.append("wake")
        self.inner.wake_up()


def test_engines_sleep_through_each_update_and_wake_before_the_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    build = runtime_module.build_generators
    monkeypatch.setattr(
        runtime_module,
        "build_generators",
        lambda cfg, policies: {pid: Recording(g, log) for pid, g in build(cfg, policies).items()},
    )
    update = runtime_module.ppo_update

    def logged_update(*args: Any, **kwargs: Any) -> Any:
        log.append("update")
        return update(*args, **kwargs)

    monkeypatch.setattr(runtime_module, "ppo_update", logged_update)
    overrides = [
        f"run.output_dir={tmp_path}",
        "train.steps=2",
        "checkpoint.every=0",
        "eval.every=0",
        "algo.entropy_coef=0.01",
    ]  # fmt: skip  (every update steps)
    train(load_config(TINY, overrides))
    calls = [c for i, c in enumerate(log) if c != "generate" or log[i - 1 : i] != ["generate"]]
    # Per step: the rollout, every engine asleep, the update, every engine awake, the sync.
    assert calls == ["generate", "sleep", "update", "wake", "sync"] * 2


def test_sleep_mode_is_on_where_vllm_has_it() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert load_config(None).rollout.vllm.sleep_mode == "auto"
    assert (sleep_engine("auto", cpu), sleep_engine("auto", gpu)) == (False, True)
    assert (sleep_engine(False, gpu), sleep_engine(True, gpu)) == (False, True)
    with pytest.raises(ConfigError, match=r"'rollout\.vllm\.sleep_mode'.*CUDA"):
        sleep_engine(True, cpu)


def test_an_engine_shared_by_several_policies_sleeps_and_wakes_once() -> None:
    """LoRA policies on one base share an engine: each generator's sleep reaches it, the first
    one acts; waking drops every cached prefix; an asleep engine refuses to generate."""
    from atgrpo.generation.base import SamplingParams
    from atgrpo.generation.vllm import VLLMEngine

    calls: list[str] = []

    class FakeLLM:
        def sleep(self, level: int) -> None:
            calls.append(f"sleep {level}")

        def wake_up(self) -> None:
            calls.append("wake")

        def reset_prefix_cache(self) -> bool:
            calls.append("reset")
            return True

    engine = VLLMEngine.__new__(VLLMEngine)  # the engine's state, without starting vLLM
    engine.llm, engine.sleep_mode, engine.asleep = FakeLLM(), True, False
    engine.sleep()
    engine.sleep()  # the second policy on the same engine
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[1, 2]], SamplingParams(4, 1.0, 0, 1.0), stop_ids=[0])
    engine.wake_up()
    engine.wake_up()
    assert calls == ["sleep 1", "wake", "reset"]
    engine.sleep_mode = False  # started without sleep mode: sleeping is a no-op
    engine.sleep()
    assert not engine.asleep and calls == ["sleep 1", "wake", "reset"]
