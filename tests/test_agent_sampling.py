"""Per-agent sampling (rollout.agents), each sample scored at its own temperature, the advantage
std's scope (algo.adv_std_scope) and policies that do not train (policies.<id>.trainable)."""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from atgrpo.algo.advantage import Grouping, StdKind, StdScope, assign_advantages
from atgrpo.algo.loss import LossAggregation, OldLogprobs
from atgrpo.algo.records import Sample
from atgrpo.algo.rollout import collect_rollout
from atgrpo.algo.update import UpdateSettings, ppo_update
from atgrpo.config import ConfigError, load_config
from atgrpo.envs import PlanPathConfig, PlanPathEnv
from atgrpo.generation import Generation, HFGenerator, SamplingParams
from atgrpo.policies import build_policy
from atgrpo.training.loop import train
from atgrpo.training.runtime import build_runtime
from atgrpo.training.settings import eval_rollout_settings, train_rollout_settings
from conftest import REPO
from helpers import UPDATE_DEFAULTS, adv_settings

TINY = REPO / "configs" / "tiny.yaml"
PER_ROLE = REPO / "configs" / "tiny-per_role.yaml"
AGENTS = ("tool", "planner")
FAST = ("rollout.max_prompt_tokens=2048", "rollout.max_new_tokens=8")


# ---------------------------------------------------------------------------------------------
# The per-agent block


def test_per_agent_settings_fall_back_to_the_rollouts() -> None:
    cfg = load_config(
        TINY,  # sets rollout.max_new_tokens_per_agent.planner = 1
        ["rollout.agents.tool.temperature=0.7", "rollout.agents.tool.max_new_tokens=30",
         "rollout.agents.planner.top_k=5", "rollout.top_p=0.9"],
    )  # fmt: skip
    tool, planner = cfg.rollout.agent("tool").params, cfg.rollout.agent("planner").params
    assert tool == SamplingParams(max_new_tokens=30, temperature=0.7, top_k=0, top_p=0.9)
    assert planner == SamplingParams(max_new_tokens=1, temperature=1.0, top_k=5, top_p=0.9)
    # Evaluation changes the same record: eval.max_new_tokens comes under the agent's own cap.
    held_out = eval_rollout_settings(load_config(TINY, ["eval.max_new_tokens=7"]), AGENTS)
    assert held_out.params("tool").max_new_tokens == 7  # no cap of its own
    assert held_out.params("planner").max_new_tokens == 1  # its own cap


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # The older key and the new one set one agent's cap: an error, whatever the values.
        (
            ["rollout.agents.planner.max_new_tokens=1"],
            "invalid value for 'rollout.agents.planner.max_new_tokens': "
            "rollout.max_new_tokens_per_agent.planner sets it too",
        ),
        (
            ["rollout.agents.planner.temprature=0.5"],
            "unknown config key 'rollout.agents.planner.temprature' (did you mean "
            "'rollout.agents.planner.temperature'?)",
        ),
        (["rollout.agents.tool.top_p=2"], "invalid value for 'rollout.agents.tool.top_p'"),
        (
            [
                "algo.grouping=trajectory",
                "rollout.sampling=independent",
                "algo.adv_std_scope=agent",
            ],
            "invalid value for 'algo.adv_std_scope': agent needs per-sample advantages",
        ),
    ],
)
def test_per_agent_config_errors_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_unknown_agent_fails_before_any_model_is_loaded(tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "rollout.agents.plnner.top_k=3"])
    message = "invalid value for 'rollout.agents.plnner': the env has no agent 'plnner'"
    for build in (
        lambda: build_runtime(cfg),
        lambda: train_rollout_settings(cfg, AGENTS),
        lambda: eval_rollout_settings(cfg, AGENTS),
    ):
        with pytest.raises(ConfigError) as info:
            build()
        assert message in str(info.value) and "\n" not in str(info.value)


class RecordingGenerator:
    """Records the SamplingParams of every call, per role; answers a short scripted text."""

    def __init__(self) -> None:
        self.params: list[tuple[str, SamplingParams]] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        tool = bytes(t for t in prompts[0] if t < 256).find(b"Python") >= 0
        self.params.append(("tool" if tool else "planner", params))
        text = '```python\nprint("U")\n```' if tool else "Moves: U"
        ids = [min(ord(c), 255) for c in text[: params.max_new_tokens]]
        return [Generation(ids, [-1.0] * len(ids), text, True) for _ in prompts]

    def sync_weights(self) -> None:
        return None

    def sleep(self) -> None:
        return None

    def wake_up(self) -> None:
        return None


def _encode(messages: list[dict[str, str]]) -> list[int]:
    return list("\n".join(m["content"] for m in messages).encode("utf-8", "replace"))


OWN = (
    "rollout.agents.tool.temperature=0.7",
    "rollout.agents.tool.max_new_tokens=30",
    "rollout.agents.planner.top_k=5",
    "rollout.agents.planner.top_p=0.8",
)


def test_each_agent_samples_with_its_own_settings_lookahead_probes_too() -> None:
    cfg = load_config(TINY, OWN)
    settings = train_rollout_settings(cfg, AGENTS)
    assert settings.lookahead  # the tool's branches are credited after a planner probe
    envs = []
    for seed in range(2):
        env = PlanPathEnv(PlanPathConfig(grid_size=4, wall_ratio=0.1, workflow="mas", max_turns=2))
        env.reset(seed=seed)
        envs.append(env)
    gen = RecordingGenerator()
    with ThreadPoolExecutor(2) as pool:
        rollout = collect_rollout(
            envs, [0, 1], generators={"shared": gen}, policy_of=dict.fromkeys(AGENTS, "shared"),
            encode=_encode, settings=settings, pool=pool,
        )  # fmt: skip
    want = {"tool": SamplingParams(30, 0.7, 0, 1.0), "planner": SamplingParams(1, 1.0, 5, 0.8)}
    roles = [role for role, _ in gen.params]
    assert roles.count("planner") > roles.count("tool")  # the probes are the planner's
    assert all(params == want[role] for role, params in gen.params)
    for s in rollout.samples:  # the temperature each was sampled at, for the update
        assert s.temperature == want[s.agent_id].temperature

    sampled = load_config(TINY, [*OWN, "eval.samples_per_task=2", "eval.temperature=0.5"])
    held_out = eval_rollout_settings(sampled, AGENTS)
    assert held_out.params("tool") == SamplingParams(30, 0.5, 0, 1.0)  # eval.temperature wins
    assert held_out.params("planner") == SamplingParams(1, 0.5, 5, 0.8)
    greedy = eval_rollout_settings(cfg, AGENTS)
    assert (
        greedy.params("tool").temperature is None and greedy.params("planner").temperature is None
    )


# ---------------------------------------------------------------------------------------------
# The update scores every sample at its own temperature (invariant 3 of docs/design.md)


def _two_agent_samples(policy: object, temperatures: dict[str, float]) -> list[Sample]:
    """Three sampled responses per agent, each agent at its temperature, in fp32."""
    tok = policy.tokenizer  # type: ignore[attr-defined]
    engine = HFGenerator(policy.model, tok, share_prefill=True)  # type: ignore[attr-defined]
    torch.manual_seed(0)
    samples = []
    for (agent, temperature), text in zip(temperatures.items(), ("Moves?", "Go: R"), strict=True):
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        gens = engine.generate([prompt] * 3, SamplingParams(8, temperature, 0, 1.0))
        for k, g in enumerate(gens):
            samples.append(
                Sample(0, 0, agent, 0, k, "shared", prompt, g.token_ids, g.logprobs, 0.0, 0.0, 0.0,
                       True, advantage=k - 1.0, temperature=temperature)
            )  # fmt: skip
    return samples


@pytest.mark.parametrize("share_prefix", [True, False])
def test_each_agent_is_scored_at_its_own_temperature(tmp_path: Path, share_prefix: bool) -> None:
    # micro-batches of 8: unshared, both agents' rows share one (a per-row temperature).
    settings = UpdateSettings(
        1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.0, 8, 1e9,
        **{**UPDATE_DEFAULTS, "old_logprobs": OldLogprobs.ROLLOUT, "share_prefix": share_prefix},
    )  # fmt: skip
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}"])  # fp32
    policy = build_policy(cfg)
    samples = _two_agent_samples(policy, {"tool": 0.7, "planner": 1.5})
    # The sampler's recorded log-probs as pi_old: the update's recomputed ones equal them per
    # token, for both agents at once (the gap is the largest over every token), so ratio 1.
    stats = ppo_update(policy, samples, settings)
    assert stats.rollout_max_abs_diff < 1e-5
    assert math.isclose(stats.ratio_min, 1.0, abs_tol=1e-5)
    assert math.isclose(stats.ratio_max, 1.0, abs_tol=1e-5)
    # The trainer's own old log-probs: exactly 1.
    fresh = build_policy(cfg)
    trainer = ppo_update(
        fresh, samples, dataclasses.replace(settings, old_logprobs=OldLogprobs.TRAINER)
    )
    assert trainer.ratio_min == trainer.ratio_max == 1.0
    # Scored at the update's default (1.0) instead, the tool's tokens (sampled at 0.7) differ.
    unrecorded = [dataclasses.replace(s, temperature=None) for s in samples]
    assert ppo_update(build_policy(cfg), unrecorded, settings).rollout_max_abs_diff > 1e-2


# ---------------------------------------------------------------------------------------------
# algo.adv_std_scope


def _sample(task: int, agent: str, reward: float) -> Sample:
    return Sample(task, task, agent, 0, 0, "shared", [1], [2], [-1.0], 0.0, 0.0, reward, True)


def test_agent_std_scope_divides_by_the_agents_batch_std() -> None:
    # Agent a: task 0 rewards [0, 2], task 1 [2, 4]. Group means 1 and 3, each group's
    # population std 1. a's whole batch [0, 2, 2, 4]: mean 2, squares 4 + 0 + 0 + 4 = 8,
    # population std sqrt(8 / 4) = sqrt(2); unbiased sqrt(8 / 3).
    # Agent b: task 0 [7, 7] (tied: advantage exactly 0 whatever the scope), task 1 [1, 3]:
    # b's batch [7, 7, 1, 3]: mean 4.5, squares 6.25 + 6.25 + 12.25 + 2.25 = 27,
    # population std sqrt(27 / 4) = 2.598...; task 1's centred rewards -1, +1.
    rewards = {
        ("a", 0): [0.0, 2.0],
        ("a", 1): [2.0, 4.0],
        ("b", 0): [7.0, 7.0],
        ("b", 1): [1.0, 3.0],
    }
    samples = [_sample(t, a, r) for (a, t), rs in rewards.items() for r in rs]
    eps = 1e-6
    a_std, b_std = math.sqrt(2.0), math.sqrt(27.0 / 4.0)
    expected = [-1 / (a_std + eps), 1 / (a_std + eps), -1 / (a_std + eps), 1 / (a_std + eps)]
    expected += [0.0, 0.0, -1 / (b_std + eps), 1 / (b_std + eps)]
    agent_scope = dataclasses.replace(adv_settings(Grouping.AGENT_TURN), std_scope=StdScope.AGENT)
    assign_advantages(samples, agent_scope)
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-9)
    # Unbiased: a's batch std sqrt(8 / 3).
    assign_advantages(samples, dataclasses.replace(agent_scope, std=StdKind.UNBIASED))
    assert samples[0].advantage == pytest.approx(-1 / (math.sqrt(8 / 3) + eps), abs=1e-9)
    # The group scope (the default): each group's own std, 1 (population).
    assign_advantages(samples, adv_settings(Grouping.AGENT_TURN))
    assert [s.advantage for s in samples] == pytest.approx([-1, 1, -1, 1, 0, 0, -1, 1], abs=1e-5)


def test_agent_std_scope_is_refused_over_trajectories() -> None:
    settings = dataclasses.replace(adv_settings(Grouping.TRAJECTORY), std_scope=StdScope.AGENT)
    with pytest.raises(ValueError, match="trajectory spans agents"):
        assign_advantages([_sample(0, "a", 1.0), _sample(0, "a", 0.0)], settings)


# ---------------------------------------------------------------------------------------------
# policies.<id>.trainable: false


def _policy_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_frozen_policy_stays_bit_identical_checkpoints_and_resumes(tmp_path: Path) -> None:
    def cfg(name: str, *extra: str):  # type: ignore[no-untyped-def]
        return load_config(
            PER_ROLE,
            [f"run.output_dir={tmp_path}", f"run.name={name}", "policies.planner.trainable=false",
             "algo.entropy_coef=0.01", "algo.skip_zero_advantage=false", *FAST, *extra],
        )  # fmt: skip

    rt = build_runtime(cfg("initial"))
    try:
        initial = {
            k: v.detach().clone() for k, v in rt.policies["planner"].model.state_dict().items()
        }
    finally:
        rt.close()
    straight = train(cfg("straight"))
    assert straight.checkpoint is not None
    first = straight.history[0]
    assert "loss/tool/loss" in first and "perf/lr/tool" in first
    assert not [k for k in first if k.startswith(("loss/planner/", "perf/lr/planner"))]
    assert "reward/planner/mean" in first  # it still acts
    steps = [straight.checkpoint.parent / f"step-00000{i}" for i in (1, 2)]
    planner = [_policy_weights(step / "policy-planner") for step in steps]
    for saved in planner:  # never moved (the tied lm_head is saved as the embedding)
        assert saved and all(torch.equal(saved[k], initial[k]) for k in saved)
    tool = [_policy_weights(step / "policy-tool") for step in steps]
    assert not _same_weights(tool[0], tool[1])  # the tool trained in step 2

    train(cfg("split", "train.steps=1"))
    resumed = train(cfg("split"), resume=True)
    assert resumed.checkpoint is not None
    for pid in ("tool", "planner"):
        a = _policy_weights(straight.checkpoint / f"policy-{pid}")
        b = _policy_weights(resumed.checkpoint / f"policy-{pid}")
        assert _same_weights(a, b), pid
