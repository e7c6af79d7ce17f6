"""Regimes L1-L3 and routing (invariant 4 of docs/design.md).

L2: a step on agent A's samples changes A's adapter and leaves B's adapter and the base
bit-identical; A and B generate with different adapters. L3: a model with no samples in a step
stays bit-identical. Routing: over a mixed map (three agents on two policies) every sample
reaches exactly the policy of the agent that produced it.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from atgrpo.algo.loss import LossAggregation
from atgrpo.algo.records import Sample
from atgrpo.algo.rollout import collect_rollout
from atgrpo.algo.update import UpdateSettings, ppo_update
from atgrpo.config import ConfigError, load_config
from atgrpo.envs.base import StepOutcome, TurnBasedEnv, Workflow
from atgrpo.generation import Generation, HFGenerator, SamplingParams
from atgrpo.policies import (
    Policy,
    PolicyGenerator,
    build_policies,
    describe_regime,
    resolve_routing,
    route_samples,
    swapped_routing,
)
from atgrpo.training import runtime as runtime_module
from atgrpo.training.loop import update_policies
from atgrpo.training.runtime import build_runtime
from atgrpo.training.settings import update_settings
from conftest import REPO
from helpers import UPDATE_DEFAULTS, rollout_settings

CONFIGS = REPO / "configs"
SETTINGS = UpdateSettings(
    1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.0, 4, 1.0, **UPDATE_DEFAULTS
)


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], module: torch.nn.Module) -> set[str]:
    after = module.state_dict()
    return {k for k in before if not torch.equal(before[k], after[k])}


def _samples(policy: Policy, agent_id: str, n: int = 4) -> list[Sample]:
    """n sampled responses of ``policy`` to one prompt, advantages +1 / -1."""
    prompt = policy.tokenizer("Moves?", add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    gens = PolicyGenerator(policy, share_prefill=True).generate(
        [prompt] * n, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0)
    )
    return [
        Sample(
            task_id=0,
            seed=0,
            agent_id=agent_id,
            turn_idx=0,
            branch_idx=k,
            policy_id=policy.policy_id,
            prompt_ids=prompt,
            response_ids=g.token_ids,
            logprobs=g.logprobs,
            team_reward=0.0,
            local_reward=0.0,
            reward=0.0,
            valid=True,
            advantage=1.0 if k % 2 else -1.0,
        )
        for k, g in enumerate(gens)
    ]


# ---------------------------------------------------------------------------------------------
# L2: LoRA adapters on one base


@pytest.fixture
def lora_policies() -> dict[str, Policy]:
    return build_policies(load_config(CONFIGS / "tiny-lora.yaml"))


def _adapter_keys(model: Any, adapter: str) -> set[str]:
    return {k for k in model.state_dict() if f".{adapter}." in k}


def test_l2_adapters_share_one_base_model(lora_policies: dict[str, Policy]) -> None:
    tool, planner = lora_policies["tool"], lora_policies["planner"]
    assert tool.model is planner.model  # one model in memory, no copies
    assert (tool.adapter, planner.adapter) == ("tool", "planner")
    tool_ids = {id(p) for p in tool.params}
    assert tool_ids.isdisjoint(id(p) for p in planner.params)
    # Each optimizer holds exactly its adapter's parameters.
    names = {id(p): n for n, p in tool.model.named_parameters()}
    assert all(".tool." in names[id(p)] for p in tool.params)
    assert {id(p) for g in tool.optimizer.param_groups for p in g["params"]} == tool_ids


def test_l2_step_on_a_changes_only_a_adapter(lora_policies: dict[str, Policy]) -> None:
    tool, planner = lora_policies["tool"], lora_policies["planner"]
    model = tool.model
    before = _snapshot(model)
    stats = ppo_update(tool, _samples(tool, "tool"), SETTINGS)
    assert not stats.skipped
    changed = _changed(before, model)
    assert changed, "the tool adapter did not move"
    assert changed <= _adapter_keys(model, "tool")  # base and planner adapter bit-identical
    # The other way round: a step for the planner leaves the tool adapter as it now is.
    before = _snapshot(model)
    ppo_update(planner, _samples(planner, "planner"), SETTINGS)
    changed = _changed(before, model)
    assert changed and changed <= _adapter_keys(model, "planner")


def test_l2_generation_uses_each_agents_adapter(lora_policies: dict[str, Policy]) -> None:
    tool, planner = lora_policies["tool"], lora_policies["planner"]
    prompt = tool.tokenizer("Where is the goal?", add_special_tokens=False)["input_ids"]

    def greedy(policy: Policy) -> list[int]:
        gen = PolicyGenerator(policy, share_prefill=True).generate(
            [prompt], SamplingParams(max_new_tokens=12, temperature=None, top_k=0, top_p=1.0)
        )
        return gen[0].token_ids

    engine = HFGenerator(tool.model, tool.tokenizer, share_prefill=True)
    with tool.model.disable_adapter():
        out = engine.generate(
            [prompt], SamplingParams(max_new_tokens=12, temperature=None, top_k=0, top_p=1.0)
        )
        base = out[0].token_ids
    assert greedy(tool) == greedy(planner) == base  # fresh adapters are zero updates (B = 0)
    with torch.no_grad():  # perturb the tool's adapter only
        gen = torch.Generator().manual_seed(1)
        for p in tool.params:
            p.add_(torch.randn(p.shape, generator=gen))
    tool_out, planner_out = greedy(tool), greedy(planner)
    assert tool_out != planner_out and planner_out == base
    assert greedy(planner) == planner_out and greedy(tool) == tool_out  # switching is not sticky


# ---------------------------------------------------------------------------------------------
# L3: separate models


def test_l3_a_policy_without_samples_stays_bit_identical(tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / "tiny-per_role.yaml", [f"run.output_dir={tmp_path}"])
    rt = build_runtime(cfg)
    try:
        tool, planner = rt.policies["tool"], rt.policies["planner"]
        assert tool.model is not planner.model
        # the peak learning rates (the schedule starts warming up from a tenth of them)
        assert tool.optimizer.param_groups[0]["initial_lr"] == pytest.approx(1e-3)
        assert planner.optimizer.param_groups[0]["initial_lr"] == pytest.approx(5e-4)
        assert planner.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.01)
        before_tool, before_planner = _snapshot(tool.model), _snapshot(planner.model)
        stats = update_policies(rt, _samples(tool, "tool"))
        assert not stats["tool"].skipped and stats["planner"].skipped
        assert _changed(before_tool, tool.model)
        assert not _changed(before_planner, planner.model)
    finally:
        rt.close()


# ---------------------------------------------------------------------------------------------
# Routing over a mixed map: three agents on two policies


class ThreeAgentEnv(TurnBasedEnv):
    """a -> b -> c, two turns; the prompt names the agent and turn; nothing to solve."""

    def __init__(self) -> None:
        super().__init__(Workflow("three", ("a", "b", "c"), max_turns=2))

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        self._seed = seed
        self._start_episode()

    def observe(self, agent_id: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{agent_id}|{self.turn_idx}|{self.seed}"}]

    def step(self, action: str) -> StepOutcome:
        self._advance(task_over=False)
        return StepOutcome(0.0, float(len(action)), True)

    def clone(self) -> ThreeAgentEnv:
        return copy.deepcopy(self)

    @property
    def success(self) -> bool:
        return False


class RecordingGenerator:
    def __init__(self) -> None:
        self.agents: list[str] = []

    def generate(self, prompts, params):
        out = []
        for k, p in enumerate(prompts):
            self.agents.append(bytes(p).decode().split("|")[0])
            out.append(Generation([65 + k % 3], [-1.0], "x" * (1 + k % 3), True))
        return out


def _encode(messages: list[dict[str, str]]) -> list[int]:
    return list(messages[-1]["content"].encode())


def test_every_sample_reaches_the_policy_of_its_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    policy_of = {"a": "p", "b": "q", "c": "p"}
    gens = {"p": RecordingGenerator(), "q": RecordingGenerator()}
    envs = []
    for seed in range(3):
        env = ThreeAgentEnv()
        env.reset(seed=seed)
        envs.append(env)
    settings = rollout_settings(dict.fromkeys("abc", 4), 2)
    with ThreadPoolExecutor(2) as pool:
        rollout = collect_rollout(
            envs, [0, 1, 2], generators=gens, policy_of=policy_of, encode=_encode,
            settings=settings, pool=pool,
        )  # fmt: skip
    # Generation: each policy's engine saw prompts of its own agents only.
    assert set(gens["p"].agents) == {"a", "c"} and set(gens["q"].agents) == {"b"}
    assert len(rollout.samples) == 3 * 3 * 2 * 2  # tasks x agents x turns x K
    # Update: the training loop hands each policy exactly its agents' samples.
    seen: dict[str, list[Sample]] = {}

    def fake_update(policy: Any, samples: list[Sample], settings: Any) -> Any:
        seen[policy.policy_id] = samples
        return SimpleNamespace(skipped=not samples)

    monkeypatch.setattr(runtime_module, "ppo_update", fake_update)
    cfg = load_config(None, ["algo.skip_zero_advantage=false"])
    policies = {pid: SimpleNamespace(policy_id=pid) for pid in ("p", "q")}
    rt = SimpleNamespace(
        cfg=cfg,
        learners={pid: runtime_module.LocalLearner(p) for pid, p in policies.items()},
        settings=SimpleNamespace(update=update_settings(cfg, ("a", "b", "c"))),
    )
    update_policies(rt, rollout.samples)  # type: ignore[arg-type]
    assert sorted(seen) == ["p", "q"]
    for pid, samples in seen.items():
        assert samples and all(policy_of[s.agent_id] == pid for s in samples)
    assert sum(len(v) for v in seen.values()) == len(rollout.samples)
    ids = [id(s) for v in seen.values() for s in v]
    assert len(set(ids)) == len(ids)  # each sample reaches exactly one policy


def test_route_samples_rejects_a_sample_of_an_unknown_policy() -> None:
    sample = Sample(0, 0, "a", 0, 0, "ghost", [1], [2], [-1.0], 0, 0, 0, True)
    with pytest.raises(KeyError, match="ghost"):
        route_samples([sample], ["p", "q"])


# ---------------------------------------------------------------------------------------------
# Config and routing errors: one line, naming the key


def test_default_routing_is_one_shared_policy() -> None:
    cfg = load_config(CONFIGS / "tiny.yaml")
    assert resolve_routing(cfg, ("tool", "planner")) == {"tool": "shared", "planner": "shared"}
    assert describe_regime(cfg, {"tool": "shared", "planner": "shared"}).startswith("L1")
    assert describe_regime(cfg, {"planner": "shared"}).startswith("L0")
    lora = load_config(CONFIGS / "tiny-lora.yaml")
    assert describe_regime(lora, resolve_routing(lora, ("tool", "planner"))).startswith("L2")
    per_role = load_config(CONFIGS / "tiny-per_role.yaml")
    assert describe_regime(per_role, {"tool": "tool", "planner": "planner"}).startswith("L3")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["routing.tool=nobody"], "invalid value for 'routing.tool': unknown policy 'nobody'"),
        (["policies.tool.lrr=1"], "unknown config key 'policies.tool.lrr' (did you mean"),
        (["policies.x.base=b"], "invalid value for 'policies.x.base'"),
        (["policies.a.lora.r=2"], "invalid value for 'policies.a': peft reserves"),
        (["policies.bad.id.lr=1"], "unknown config key 'policies.bad.id'"),
        (
            [
                "policies.p.lora.r=2",
                "policies.p.base=b",
                "policies.q.lora.r=2",
                "policies.q.base=b",
                "policies.q.model=/elsewhere",
            ],
            "invalid value for 'policies.q.model': base",
        ),
    ],
)
def test_policy_config_errors_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "tiny.yaml", overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_routing_errors_at_runtime_name_the_agent() -> None:
    two = load_config(None, ["policies.p.lr=1e-3", "policies.q.lr=1e-3", "routing.tool=p"])
    with pytest.raises(ConfigError, match=r"agent 'planner' has no policy: set routing.planner="):
        resolve_routing(two, ("tool", "planner"))
    typo = load_config(None, ["routing.planer=shared"])
    with pytest.raises(ConfigError, match=r"'routing\.planer': the env has no agent 'planer'"):
        resolve_routing(typo, ("tool", "planner"))


def test_swapped_routing_exchanges_two_agents_policies() -> None:
    cfg = load_config(CONFIGS / "tiny-lora.yaml")
    swap = swapped_routing(cfg, ("tool", "planner"), ("tool", "planner"))
    assert swap == ["routing.tool=planner", "routing.planner=tool"]
    swapped = load_config(CONFIGS / "tiny-lora.yaml", swap)
    assert resolve_routing(swapped, ("tool", "planner")) == {"tool": "planner", "planner": "tool"}


def test_l2_kl_reference_is_the_base_with_adapters_off(lora_policies: dict[str, Policy]) -> None:
    tool = lora_policies["tool"]
    kl = UpdateSettings(
        1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.1, 0.0, 4, 1.0, **UPDATE_DEFAULTS
    )
    samples = _samples(tool, "tool")
    # A fresh adapter is a zero update (B = 0): the policy is its reference, KL = 0.
    assert ppo_update(tool, samples, kl).kl == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        for p in tool.params:
            p.add_(0.5 * torch.randn_like(p))
    assert ppo_update(tool, samples, kl).kl > 1e-4


def test_extends_updates_sections_and_replaces_policies(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(
        "env: {name: plan_path, grid_size: 5, max_turns: 3}\n"
        "algo: {alpha: 0.5}\n"
        "policies: {a1: {lr: 0.1}, b1: {lr: 0.2}}\n"
        "routing: {tool: a1, planner: b1}\n"
    )
    (tmp_path / "child.yaml").write_text(
        "extends: base.yaml\nenv: {grid_size: 6}\npolicies: {only: {}}\nrouting: {}\n"
    )
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.env.grid_size, cfg.env.max_turns, cfg.algo.alpha) == (6, 3, 0.5)
    assert list(cfg.policies) == ["only"] and cfg.routing == {}
    (tmp_path / "loop.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "loop.yaml")


def test_the_vllm_engine_is_eager_on_cpu_and_graphs_on_a_gpu_unless_told() -> None:
    from atgrpo.policies import eager_engine

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert load_config(None).rollout.vllm.enforce_eager == "auto"
    assert (eager_engine("auto", cpu), eager_engine("auto", gpu)) == (True, False)
    assert (eager_engine(True, gpu), eager_engine(False, cpu)) == (True, False)
