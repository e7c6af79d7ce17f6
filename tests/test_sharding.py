"""Sharded worker groups: FSDP2 over a policy's ranks (atgrpo.distributed.sharding), on CPU with
gloo.

Default tier: the config refuses what a sharded group does not run, with the key and the fix,
and the tiny model's decoder layers are found bare and inside peft.

Tier ``scale`` (``make test-scale``, Ray on a simulated cluster of two one-CPU nodes, one rank
per node):

* Two sharded ranks take the step one process takes on the same batch (loss, statistics and
  every updated weight), with micro-batches that need padding on one rank and the KL term's
  reference sharded too; each rank holds half of the parameters and of the AdamW state.
* The sharded checkpoint resumes to the same next step on two ranks and in one process.
* LoRA adapters on a sharded base take the single-process step and save as adapters alone.
* A two-step run trains through a sharded group (its rollout copies synced after each update,
  ``perf/sync_s``), checkpoints and resumes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from atgrpo.algo.loss import LossAggregation
from atgrpo.algo.update import UpdateSettings, UpdateStats, ppo_update
from atgrpo.checkpoint import restore_policy_state
from atgrpo.config import ConfigError, load_config
from atgrpo.distributed.sharding import decoder_layers
from atgrpo.models import load_model, prepare_tiny_model
from atgrpo.policies import build_policies, build_policy
from atgrpo.training.loop import train
from conftest import REPO
from helpers import UPDATE_DEFAULTS, mixed_batch

TINY = REPO / "configs" / "tiny.yaml"
LORA = REPO / "configs" / "tiny-lora.yaml"
SHARD = ("backend.kind=ray", "train.share_prefix=false")
STATS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ratio_mean", "grad_norm")


def test_the_config_names_what_a_sharded_group_needs(tmp_path: Path) -> None:
    shard = "backend.policies.shared.sharding=shard"
    cases = [
        ([shard, "train.share_prefix=false"], "backend.kind=ray"),
        ([shard, *SHARD, "rollout.engine=vllm"], "rollout.engine=hf"),
        ([shard, "backend.kind=ray"], "train.share_prefix=false"),
    ]
    for overrides, fix in cases:
        with pytest.raises(ConfigError, match=fix):
            load_config(TINY, [f"run.output_dir={tmp_path}", *overrides])
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", shard, *SHARD])
    assert cfg.backend.policies["shared"].sharding.value == "shard"


def test_decoder_layers_are_found_bare_and_inside_peft() -> None:
    from peft import LoraConfig, get_peft_model

    model, _ = load_model(prepare_tiny_model())
    bare = decoder_layers(model)
    assert bare and all(type(m).__name__ == "LlamaDecoderLayer" for m in bare)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    assert len(decoder_layers(get_peft_model(model, lora))) == len(bare)
    with pytest.raises(ValueError, match="sharding: replicate"):
        decoder_layers(torch.nn.Linear(2, 2))


class _RunsCode:
    """Unpickling this calls ``Path.touch`` on a marker: a stand-in for any code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.marker),))  # type: ignore[return-value]


def _stepped(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model after one AdamW step: weights, moments and learning rate set by ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_shards_load_without_unpickling_code(tmp_path: Path) -> None:
    import pickle
    import re

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from atgrpo.checkpoint import CheckpointError
    from atgrpo.checkpoint.shards import load_shards

    saved = _stepped(0)
    model_sd, optim_sd = get_state_dict(*saved)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "ok", no_dist=True)
    model, optimizer = _stepped(1)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    load_shards(state, tmp_path / "ok", no_dist=True)  # the metadata with the allow-list
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    for got, want in zip(model.parameters(), saved[0].parameters(), strict=True):
        assert torch.equal(got, want)
        assert torch.equal(optimizer.state[got]["exp_avg"], saved[1].state[want]["exp_avg"])
    assert optimizer.param_groups[0]["lr"] == 1e-3  # a non-tensor value, read as plain data

    # A non-tensor value whose pickle would run code (DCP's own planner would unpickle it).
    marker = tmp_path / "ran"
    dcp.save({"x": _RunsCode(marker)}, checkpoint_id=tmp_path / "bad", no_dist=True)
    shard = str(tmp_path / "bad" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"could run code \(it names getattr\)") as refused:
        load_shards({"x": 0}, tmp_path / "bad", no_dist=True)
    assert str(refused.value).startswith(f"{shard} holds pickled objects") and not marker.exists()

    # Metadata that sends the reader to a file outside its folder.
    path = tmp_path / "ok" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # written above by this test
    for info in metadata.storage_data.values():
        info.relative_path = "../bad/__0_0.distcp"
    path.write_bytes(pickle.dumps(metadata))
    outside = re.escape("names '../bad/__0_0.distcp', no shard file beside it")
    with pytest.raises(CheckpointError, match=outside):
        load_shards(state, tmp_path / "ok", no_dist=True)


# ---------------------------------------------------------------------------------------------
# Tier scale: Ray, two gloo ranks


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    """A simulated cluster of two nodes with one CPU each (started and stopped here)."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def _sharded(path: Path, root: Path, cluster: Any, group: str, *extra: str) -> Any:
    return load_config(
        path,
        [
            f"run.output_dir={root}",
            *SHARD,
            f"backend.address={cluster.address}",
            f"backend.policies.{group}.num_workers=2",
            f"backend.policies.{group}.placement=STRICT_SPREAD",  # one rank per node
            f"backend.policies.{group}.sharding=shard",
            *extra,
        ],
    )


def _settings(kl: float) -> UpdateSettings:
    # Micro-batches of 3: the ranks' 4 and 3 samples run 2 and 1, so one rank pads.
    defaults = {**UPDATE_DEFAULTS, "share_prefix": False}
    return UpdateSettings(1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, kl, 0.01, 3, 1.0, **defaults)


def _assert_same_stats(got: UpdateStats, want: UpdateStats) -> None:
    assert not want.skipped and not got.skipped
    assert (got.num_samples, got.num_tokens) == (want.num_samples, want.num_tokens)
    for k in STATS:
        assert getattr(got, k) == pytest.approx(getattr(want, k), abs=1e-5), k


def _assert_saved_weights(folder: Path, model: Any, file: str = "model.safetensors") -> int:
    """The saved full weights equal ``model``'s; returns how many tensors were compared."""
    from safetensors.torch import load_file

    saved = load_file(str(folder / file))
    state = model.state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, state[name], atol=1e-5, rtol=0)
    return len(saved)


@pytest.mark.scale
def test_sharded_ranks_take_the_single_process_step_and_resume_on_two_ranks_and_one(
    two_nodes: Any, tmp_path: Path
) -> None:
    from atgrpo.distributed import start_ray_policies

    cfg = _sharded(TINY, tmp_path, two_nodes, "shared", "algo.kl_coef=0.05")
    settings = _settings(kl=0.05)
    policy = build_policy(cfg)
    first, second = mixed_batch(policy), mixed_batch(policy, flip=True)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    want = ppo_update(policy, first, settings)
    checkpoint = tmp_path / "step-1"
    remote = start_ray_policies(cfg)
    try:
        learner = remote.learners["shared"]
        got = learner.update(first, settings).result()
        sizes = learner.shard_sizes()
        learner.save(checkpoint / "policy-shared")
    finally:
        remote.close()
    _assert_same_stats(got, want)
    assert _assert_saved_weights(checkpoint / "policy-shared", policy.model)
    assert any(not torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
    # Each rank holds half (to a row) of the weights and of AdamW's two moments.
    assert sum(s.params_local for s in sizes) == sizes[0].params_full
    assert sum(s.optimizer_local for s in sizes) == sizes[0].optimizer_full
    assert sizes[0].optimizer_full == 2 * sizes[0].params_full
    for s in sizes:
        assert 0.45 < s.params_local / s.params_full < 0.55
        assert 0.45 < s.optimizer_local / s.optimizer_full < 0.55

    # The next step: this process going on, one process resumed, two ranks resumed.
    want_next = ppo_update(policy, second, settings)
    weights = {"shared": checkpoint / "policy-shared"}
    one = build_policies(cfg, weights)["shared"]
    restore_policy_state(checkpoint, one)
    _assert_same_stats(ppo_update(one, second, settings), want_next)
    for name, tensor in policy.model.state_dict().items():
        torch.testing.assert_close(one.model.state_dict()[name], tensor, atol=1e-5, rtol=0)
    remote = start_ray_policies(cfg, weights)
    try:
        learner = remote.learners["shared"]
        learner.restore(checkpoint)
        got_next = learner.update(second, settings).result()
        learner.save(tmp_path / "step-2" / "policy-shared")
    finally:
        remote.close()
    _assert_same_stats(got_next, want_next)
    _assert_saved_weights(tmp_path / "step-2" / "policy-shared", policy.model)


@pytest.mark.scale
def test_lora_adapters_on_a_sharded_base_take_the_single_process_step(
    two_nodes: Any, tmp_path: Path
) -> None:
    from atgrpo.distributed import start_ray_policies

    cfg = _sharded(LORA, tmp_path, two_nodes, "tool")  # the group is named by its first policy
    settings = _settings(kl=0.0)
    torch.manual_seed(cfg.run.seed)  # as the driver and every worker seed: adapters start alike
    local = build_policies(cfg)
    batch = mixed_batch(local["tool"], "tool")
    want = ppo_update(local["tool"], batch, settings)
    remote = start_ray_policies(cfg)
    try:
        got = remote.learners["tool"].update(batch, settings).result()
        sizes = remote.learners["tool"].shard_sizes()
        assert remote.learners["planner"].update([], settings).result().skipped
        remote.learners["tool"].save(tmp_path / "ck" / "policy-tool")
    finally:
        remote.close()
    _assert_same_stats(got, want)
    assert sum(s.params_local for s in sizes) == sizes[0].params_full  # the adapter, sharded
    folder = tmp_path / "ck" / "policy-tool"
    assert (folder / "adapter_config.json").is_file() and (folder / "sharded").is_dir()
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(folder / "adapter_model.safetensors"))
    state = get_peft_model_state_dict(local["tool"].model, adapter_name="tool")
    assert saved.keys() == state.keys()
    for name, tensor in state.items():
        torch.testing.assert_close(saved[name], tensor, atol=1e-5, rtol=0)


@pytest.mark.scale
def test_a_run_trains_checkpoints_and_resumes_through_a_sharded_group(
    two_nodes: Any, tmp_path: Path
) -> None:
    cfg = _sharded(TINY, tmp_path, two_nodes, "shared", "rollout.max_new_tokens=8")
    result = train(cfg)
    assert result.steps_done == 2 and result.checkpoint is not None
    assert (result.checkpoint / "policy-shared" / "sharded" / ".metadata").is_file()
    stepped = [m for m in result.history if not m["loss/skipped"]]
    assert stepped and all(m["perf/sync_s"] > 0.0 for m in stepped)
    longer = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 3})})
    resumed = train(longer, resume=True)
    assert resumed.steps_done == 3 and len(resumed.history) == 1


@pytest.mark.scale
def test_sharded_ranks_take_several_optimizer_steps_per_rollout(
    two_nodes: Any, tmp_path: Path
) -> None:
    import dataclasses

    from atgrpo.distributed import start_ray_policies

    cfg = _sharded(TINY, tmp_path, two_nodes, "shared")
    # Mini-batches of 2 samples, at most one per prompt group (the driver plans them for the
    # whole batch and deals each one's groups to the ranks), passed over twice.
    settings = dataclasses.replace(_settings(kl=0.0), ppo_mini_batch_size=2, ppo_epochs=2)
    batch = mixed_batch(build_policy(cfg))
    per_epoch = min(-(-len(batch) // 2), len({tuple(s.prompt_ids) for s in batch}))
    remote = start_ray_policies(cfg)
    try:
        got = remote.learners["shared"].update(batch, settings).result()
        remote.learners["shared"].save(tmp_path / "ck" / "policy-shared")
    finally:
        remote.close()
    assert not got.skipped and len(got.steps) == 2 * per_epoch
    assert got.steps[0].ratio_max == 1.0 and got.steps[0].clip_frac == 0.0
    assert (tmp_path / "ck" / "policy-shared" / "sharded").is_dir()
