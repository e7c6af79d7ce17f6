"""Scale-out: the Ray backend and data parallelism, on CPU.

Default tier (no Ray): the package imports without ray, GPU configs resolve their worker
groups, backend errors name the key, two ranks (threads standing in for torch.distributed)
take the single-process step, and the built-in envs pickle for env workers (code and math
without their datasets). Tier ``scale`` (``make test-scale``, needs the ``ray`` extra):

* Two training steps of L3 (two policies, two worker groups) on Ray give the same samples,
  advantages, losses and weights as the in-process path on the same seed: on a local cluster
  the run starts (2 CPUs) and stops, and on a simulated two-node cluster it joins and leaves
  running; on the two nodes again with two env workers, which run every env step and every
  tool program (the driver runs none).
* A policy group of two ranks (gloo, one per simulated node) takes the same step as one process
  on the same batch.

Ray's start-up is slow, so the two-node cluster is shared by the module.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from atgrpo import sandbox
from atgrpo.algo.loss import LossAggregation
from atgrpo.algo.update import DataParallel, UpdateSettings, ppo_update
from atgrpo.config import Config, ConfigError, load_config
from atgrpo.data.math import Benchmark, MathDataConfig, TrainSource
from atgrpo.distributed.layout import group_resources, worker_groups
from atgrpo.envs import (
    ENV_REGISTRY,
    CodeEnv,
    MathConfig,
    MathEnv,
    PlanPathEnv,
    SokobanConfig,
    SokobanEnv,
    StepOutcome,
    SudokuConfig,
    SudokuEnv,
)
from atgrpo.envs.puzzle import PuzzleEnv
from atgrpo.policies import build_policy
from atgrpo.training.loop import train
from conftest import REPO
from helpers import UPDATE_DEFAULTS, mixed_batch

PER_ROLE = REPO / "configs" / "tiny-per_role.yaml"
TINY = REPO / "configs" / "tiny.yaml"
# Short prompts and answers: the same code paths in a few seconds; every sample is logged. Primed
# answers make the tool's completion a program (```python ...), run in the sandbox.
FAST = (
    "rollout.max_prompt_tokens=2048",
    "rollout.max_new_tokens=8",
    "run.log_samples=2",
    "env.prime_answers=true",
    # Every agent answers up to 8 tokens (tiny.yaml gives the planner 1), so lengths, and with
    # them GradedPlanPath's rewards, spread in every group.
    "rollout.max_new_tokens_per_agent={}",
)
LOSSES = ("loss", "pg_loss", "entropy", "clip_frac", "ratio_mean", "approx_kl", "grad_norm")


@pytest.fixture(scope="module")
def ray() -> Any:
    return pytest.importorskip("ray")


class GradedPlanPath(PlanPathEnv):
    """Plan-Path with a local bonus of 0.01 per character of the answer, so that groups spread.

    The tiny model never writes a valid action, so every reward in a group would tie and every
    advantage would be 0.
    """

    def step(self, action: str) -> StepOutcome:
        out = super().step(action)
        return dataclasses.replace(out, local_reward=out.local_reward + 0.01 * len(action))


@pytest.fixture(scope="module")
def graded_rewards(ray: Any) -> Iterator[None]:
    """Runs build :class:`GradedPlanPath` envs, here and (pickled by value) in env workers."""
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    this_module = sys.modules[__name__]  # env workers cannot import tests/: send its classes
    cloudpickle.register_pickle_by_value(this_module)
    try:
        with pytest.MonkeyPatch.context() as mp:
            graded = dataclasses.replace(ENV_REGISTRY["plan_path"], env_class=GradedPlanPath)
            mp.setitem(ENV_REGISTRY, "plan_path", graded)
            yield
    finally:
        cloudpickle.unregister_pickle_by_value(this_module)


def _cfg(root: Path, name: str, *extra: str) -> Config:
    return load_config(PER_ROLE, [f"run.output_dir={root}", f"run.name={name}", *FAST, *extra])


@dataclasses.dataclass
class Run:
    samples: list[tuple[Any, ...]]  # (step, task, agent, turn, branch, response)
    advantages: list[float]
    losses: list[dict[str, float]]  # per step
    weights: dict[str, dict[str, torch.Tensor]]  # per policy, after the last step


def _run(cfg: Config) -> Run:
    from safetensors.torch import load_file

    result = train(cfg)
    assert result.steps_done == 2 and result.checkpoint is not None
    lines = (cfg.run_dir / "samples.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    keys = ("step", "task_id", "agent_id", "turn_idx", "branch_idx", "response")
    return Run(
        samples=[tuple(r[k] for k in keys) for r in records],
        advantages=[r["advantage"] for r in records],
        losses=[
            {k: v for k, v in m.items() if k.startswith("loss/") and k.split("/")[-1] in LOSSES}
            for m in result.history
        ],
        weights={
            pid: load_file(str(result.checkpoint / f"policy-{pid}" / "model.safetensors"))
            for pid in ("tool", "planner")
        },
    )


@pytest.fixture(scope="module")
def in_process(graded_rewards: None, tmp_path_factory: pytest.TempPathFactory) -> Run:
    programs: list[str] = []
    run_python = sandbox.run_python

    def counted(code: str, *args: Any, **kwargs: Any) -> Any:
        programs.append(code)
        return run_python(code, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sandbox, "run_python", counted)
        run = _run(_cfg(tmp_path_factory.mktemp("local"), "in-process"))
    assert programs  # the tool agent's programs ran in the sandbox
    # The comparison has teeth: advantages spread, both policies learn from them.
    assert any(abs(a) > 0.1 for a in run.advantages)
    for pid in ("tool", "planner"):
        assert all(step[f"loss/{pid}/grad_norm"] > 1e-3 for step in run.losses)
    return run


def _assert_same_run(got: Run, want: Run) -> None:
    assert got.samples == want.samples  # the same sampled answers, in the same order
    assert got.advantages == pytest.approx(want.advantages, abs=1e-6)
    for step_got, step_want in zip(got.losses, want.losses, strict=True):
        assert step_got.keys() == step_want.keys()
        for k in step_want:
            assert step_got[k] == pytest.approx(step_want[k], abs=1e-6), k
    # Weights after two Adam steps: equal up to float summation order (a worker runs torch on
    # the threads of its CPUs, this process on all of them).
    for pid, tensors in want.weights.items():
        for name, tensor in tensors.items():
            torch.testing.assert_close(got.weights[pid][name], tensor, atol=1e-5, rtol=0)


@pytest.mark.scale
def test_ray_on_a_local_cluster_matches_the_in_process_run(
    ray: Any, in_process: Run, tmp_path: Path
) -> None:
    assert not ray.is_initialized()
    cfg = _cfg(tmp_path, "ray-local", "backend.kind=ray", "backend.num_cpus=2")
    _assert_same_run(_run(cfg), in_process)
    assert not ray.is_initialized()  # the run stopped the cluster it started


@pytest.fixture(scope="module")
def two_nodes(ray: Any) -> Iterator[Any]:
    """A simulated cluster of two nodes with one CPU each (this test starts and stops it)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.mark.scale
def test_ray_on_two_nodes_matches_the_in_process_run(
    ray: Any, in_process: Run, two_nodes: Any, tmp_path: Path
) -> None:
    # One CPU per node and one per group: the tool's and the planner's groups sit on
    # different nodes.
    address = f"backend.address={two_nodes.address}"
    cfg = _cfg(tmp_path, "ray-two-nodes", "backend.kind=ray", address)
    _assert_same_run(_run(cfg), in_process)
    assert not ray.is_initialized()  # disconnected ...
    ray.init(address=two_nodes.address)
    try:  # ... and the cluster it joined still runs, both nodes
        assert sum(node["Alive"] for node in ray.nodes()) == 2
    finally:
        ray.shutdown()


@pytest.mark.scale
def test_env_workers_on_two_nodes_match_the_in_process_run(
    ray: Any, in_process: Run, two_nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def not_here(self: PuzzleEnv, action: str) -> StepOutcome:
        raise AssertionError("an env step (and its program) ran in the driver")

    # The driver's envs cannot step; the env workers import their own, unpatched, PuzzleEnv.
    monkeypatch.setattr(PuzzleEnv, "step", not_here)
    cfg = _cfg(
        tmp_path,
        "ray-env-workers",
        "backend.kind=ray",
        f"backend.address={two_nodes.address}",
        "backend.num_env_workers=2",
        "backend.env_worker_cpus=0",  # the two policy groups hold both nodes' CPUs
    )
    _assert_same_run(_run(cfg), in_process)
    assert not ray.is_initialized()  # the env workers went with the run's connection


@pytest.mark.scale
@pytest.mark.parametrize("mini_batch", [0, 2])  # 2: 3 mini-batches planned on the driver
def test_two_rank_gloo_update_equals_the_single_process_step(
    ray: Any, two_nodes: Any, tmp_path: Path, mini_batch: int
) -> None:
    from safetensors.torch import load_file

    from atgrpo.distributed import start_ray_policies

    cfg = load_config(
        TINY,
        [
            f"run.output_dir={tmp_path}",
            "backend.kind=ray",
            f"backend.address={two_nodes.address}",
            "backend.policies.shared.num_workers=2",
            "backend.policies.shared.placement=STRICT_SPREAD",  # one rank per node
        ],
    )
    # Micro-batches of 2: ranks of 4 and 3 samples run 2 micro-batches each, padded differently.
    settings = UpdateSettings(
        1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.01, 2, 1.0, **UPDATE_DEFAULTS
    )
    settings = dataclasses.replace(settings, ppo_mini_batch_size=mini_batch, ppo_epochs=2)
    policy = build_policy(cfg)
    samples = mixed_batch(policy)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    want = ppo_update(policy, samples, settings)
    assert not want.skipped
    remote = start_ray_policies(cfg)
    try:
        learner = remote.learners["shared"]
        got = learner.update(samples, settings).result()
        digests = learner.digests()
        learner.save(tmp_path / "dp")
    finally:
        remote.close()
    assert not ray.is_initialized()
    assert len(digests) == 2 and digests[0] == digests[1]  # the ranks took the same steps
    assert (got.num_samples, got.num_tokens) == (want.num_samples, want.num_tokens)
    assert got.optimizer_steps == want.optimizer_steps == (6 if mini_batch else 2)
    for k in ("loss", "pg_loss", "entropy", "ratio_mean", "grad_norm"):
        assert getattr(got, k) == pytest.approx(getattr(want, k), abs=1e-6), k
    after = load_file(str(tmp_path / "dp" / "model.safetensors"))
    moved = 0
    for name, tensor in policy.model.state_dict().items():
        if name in after:
            torch.testing.assert_close(after[name], tensor, atol=1e-5, rtol=0)
            moved += not torch.equal(before[name], tensor)
    assert moved  # the step changed the weights


# ---------------------------------------------------------------------------------------------
# Default tier: no Ray


def test_the_distributed_package_imports_without_ray() -> None:
    code = (
        "import sys, atgrpo.distributed, atgrpo.distributed.layout, atgrpo.training.loop; "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_gpu_configs_give_each_policy_its_resource_pool() -> None:
    gpu = REPO / "configs" / "gpu"
    for size in ("1.7b", "8b"):
        for domain in ("plan_path", "sudoku", "sokoban", "code", "math"):
            for regime in ("mas", "mas-per_role"):
                if (size, regime) == ("1.7b", "mas"):
                    continue  # the single-GPU, in-process configs
                cfg = load_config(gpu / f"qwen3-{size}-{domain}-{regime}.yaml")
                assert cfg.backend.kind.value == "ray"
                groups = worker_groups(cfg)
                # per role: one group (own model, own GPUs) per policy; shared: one group
                assert len(groups) == (2 if regime.endswith("per_role") else 1)
                assert sorted(p for ids in groups.values() for p in ids) == sorted(cfg.policies)
                for ids in groups.values():
                    assert group_resources(cfg, ids).num_gpus >= 1
    for domain in ("plan_path", "sudoku", "sokoban", "code", "math"):
        # 8B whole-model training: one group, sharded over 8 GPUs
        cfg = load_config(gpu / f"qwen3-8b-{domain}-mas-full.yaml")
        assert cfg.policies["shared"].lora is None
        assert cfg.backend.policies["shared"].sharding.value == "shard"
        assert group_resources(cfg, ["shared"]).num_workers == 8


def test_backend_errors_name_the_key() -> None:
    cfg = load_config(PER_ROLE, ["backend.policies.coder.num_gpus=1"])
    with pytest.raises(ConfigError, match=r"'backend\.policies\.coder': unknown policy 'coder'"):
        group_resources(cfg, ["tool"])
    # LoRA adapters on one base live in one group: the first policy's entry is the group's.
    lora = load_config(
        REPO / "configs" / "tiny-lora.yaml",
        ["backend.policies.tool.num_cpus=2", "backend.policies.planner.num_cpus=3"],
    )
    assert list(worker_groups(lora).values()) == [["tool", "planner"]]
    with pytest.raises(ConfigError, match=r"'backend\.policies\.planner': LoRA policies"):
        group_resources(lora, ["tool", "planner"])
    with pytest.raises(ConfigError, match=r"'backend\.num_env_workers': env workers are Ray"):
        load_config(PER_ROLE, ["backend.num_env_workers=2"])  # backend.kind: local


def _problems(path: Path, first: int, n: int) -> str:
    rows = [{"id": f"p{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)}
            for i in range(first, first + n)]  # fmt: skip
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return str(path)


def test_envs_pickle_for_env_workers_without_their_datasets(tmp_path: Path) -> None:
    data = MathDataConfig(
        train=TrainSource.LOCAL,
        train_path=_problems(tmp_path / "train.jsonl", 0, 400),
        test=Benchmark.LOCAL,
        test_path=_problems(tmp_path / "test.jsonl", 1000, 20),
    )
    math_env, code_env = MathEnv(MathConfig(data=data)), CodeEnv()  # code: packaged HumanEval
    for env, dataset in ((math_env, math_env.splits), (code_env, code_env.dataset)):
        env.reset(seed=0)
        sent = pickle.dumps(env)
        assert len(sent) * 10 < len(pickle.dumps(dataset))  # the env, not the dataset
        back = pickle.loads(sent)
        assert back.observe(back.agent_selection) == env.observe(env.agent_selection)
        assert back.step("no answer") == env.clone().step("no answer")
    assert pickle.loads(pickle.dumps(math_env)).splits is math_env.splits  # read once here
    for puzzle in (PlanPathEnv(), SudokuEnv(SudokuConfig()), SokobanEnv(SokobanConfig())):
        puzzle.reset(seed=0)
        back = pickle.loads(pickle.dumps(puzzle))
        assert back.observe(back.agent_selection) == puzzle.observe(puzzle.agent_selection)


class ThreadRanks:
    """``all_reduce`` over threads, each a rank: a stand-in for torch.distributed."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size)
        self.slots: list[Any] = [None] * world_size

    def all_reduce(self, rank: int) -> Callable[[torch.Tensor], None]:
        def reduce(tensor: torch.Tensor) -> None:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0])  # the same order on every rank
            self.barrier.wait()  # every rank has read the slots before they are reused
            tensor.copy_(total)

        return reduce


def test_two_ranks_take_the_single_process_step(tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}"])
    settings = UpdateSettings(
        1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.01, 2, 1.0, **UPDATE_DEFAULTS
    )
    single, ranks = build_policy(cfg), [build_policy(cfg), build_policy(cfg)]
    samples = mixed_batch(single)
    want = ppo_update(single, samples, settings)
    world = ThreadRanks(2)
    shards = [samples[0::2], samples[1::2]]  # 4 and 3 samples: 2 micro-batches each
    got: list[Any] = [None, None]

    def run(rank: int) -> None:
        group = DataParallel(world.all_reduce(rank), rank, 2)
        got[rank] = ppo_update(ranks[rank], shards[rank], settings, group)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] == got[1]  # every rank reports the whole batch
    assert (got[0].num_samples, got[0].num_tokens) == (want.num_samples, want.num_tokens)
    for k in ("loss", "pg_loss", "entropy", "ratio_mean", "clip_frac", "grad_norm"):
        assert getattr(got[0], k) == pytest.approx(getattr(want, k), abs=1e-6), k
    expected = single.model.state_dict()
    for rank in ranks:
        for name, tensor in rank.model.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0)


def test_workers_compute_in_the_precision_the_driver_resolved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every rank builds its policies from the driver's resolved ``model.precision``: a node
    whose own probe would choose otherwise cannot split a run between two precisions."""
    from atgrpo import policies
    from atgrpo.config import Precision
    from atgrpo.distributed.layout import worker_config

    cfg = load_config(REPO / "configs" / "tiny.yaml", ["model.precision=auto"])
    for driver in (Precision.FP32, Precision.BF16_AUTOCAST):  # what auto takes on the driver
        monkeypatch.setattr(
            policies, "bf16_supported", lambda d=driver: d is Precision.BF16_AUTOCAST
        )
        assert worker_config(cfg)["model"]["precision"] == driver.value
    fixed = load_config(REPO / "configs" / "tiny.yaml", ["model.precision=fp32"])
    assert worker_config(fixed)["model"]["precision"] == "fp32"
