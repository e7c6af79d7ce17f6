"""Responses cut at max_new_tokens (rollout.truncation): the rollout records them, DAPO's overlong
penalty enters the reward, mask leaves them out of the loss and its normalisers, and the step
reports each agent's cut share (docs/algorithm.md, "Truncated responses")."""

from __future__ import annotations

import dataclasses
import json
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from atgrpo.algo.advantage import mix_reward, trajectory_return
from atgrpo.algo.loss import LossAggregation
from atgrpo.algo.policy import Policy
from atgrpo.algo.records import EpisodeResult, Rollout, Sample
from atgrpo.algo.rollout import collect_rollout
from atgrpo.algo.truncation import Truncation, TruncationSettings, overlong_penalty
from atgrpo.algo.update import DataParallel, UpdateSettings, UpdateStats, ppo_update
from atgrpo.config import ConfigError, load_config
from atgrpo.envs import PlanPathConfig, PlanPathEnv
from atgrpo.generation import Generation, HFGenerator, SamplingParams
from atgrpo.policies import build_policy
from atgrpo.report import plots_of
from atgrpo.training.metrics import rollout_metrics
from atgrpo.training.settings import update_settings
from conftest import REPO
from helpers import UPDATE_DEFAULTS, mixed_batch, rollout_settings

TINY = REPO / "configs" / "tiny.yaml"
# No gradient clipping (1e9): a clipped gradient hides a change of scale.
BASE = UpdateSettings(
    1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.0, 3, 1e9, **UPDATE_DEFAULTS
)
MASK = dataclasses.replace(BASE, masked=frozenset({"planner"}))


# ---------------------------------------------------------------------------------------------
# DAPO's overlong penalty


def test_overlong_penalty_by_hand() -> None:
    # L_max = 10, L_cache = 4: no penalty up to L_max - L_cache = 6, then -(L - 6) / 4.
    assert overlong_penalty(3, 10, 4) == 0.0
    assert overlong_penalty(6, 10, 4) == 0.0
    assert overlong_penalty(7, 10, 4) == -0.25  # -(7 - 6) / 4
    assert overlong_penalty(9, 10, 4) == -0.75  # -(9 - 6) / 4
    assert overlong_penalty(10, 10, 4) == -1.0  # -(10 - 6) / 4: at the cap
    assert overlong_penalty(12, 10, 4) == -1.0  # past the cap (another engine's count)
    assert overlong_penalty(10, 10, 10) == -1.0  # the whole budget is the buffer
    assert overlong_penalty(0, 10, 10) == 0.0
    # Scaled by the factor, and only under overlong_penalty: 0.5 x -(8 - 6) / 4 = -0.25.
    on = TruncationSettings(Truncation.OVERLONG_PENALTY, 4, 0.5)
    assert on.penalty(8, 10) == -0.25
    for mode in (Truncation.KEEP, Truncation.MASK):
        assert TruncationSettings(mode, 4, 0.5).penalty(10, 10) == 0.0
    with pytest.raises(ValueError, match="overlong buffer 11"):
        overlong_penalty(5, 10, 11)


def test_the_penalty_is_added_outside_the_reward_weights() -> None:
    # 0.7 x 1 + 2 x 0.5 - 0.25 = 1.45: DAPO adds it to the sample's reward as it is.
    assert mix_reward(1.0, 0.5, 0.7, 2.0, -0.25) == pytest.approx(1.45)
    assert mix_reward(1.0, 0.5, 0.7, 2.0) == pytest.approx(1.7)

    def step(team: float, local: float, penalty: float) -> Sample:
        return Sample(0, 0, "planner", 0, 0, "shared", [1], [2], [-1.0], team, local, 0.0, True,
                      overlong_penalty=penalty)  # fmt: skip

    # A trajectory return adds the penalties up like the local rewards:
    # 0.7 x 0.6 (last team) + 1 x (0.1 + 0.2) + (-0.5 - 0.25) = 0.42 + 0.3 - 0.75 = -0.03.
    steps = [step(0.2, 0.1, -0.5), step(0.6, 0.2, -0.25)]
    assert trajectory_return(steps, 0.7, 1.0) == pytest.approx(-0.03)


class CuttingGenerator:
    """Scripted texts per role, one byte a token, cut at max_new_tokens (finished only if not)."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script = script

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        role = "tool" if bytes(t for t in prompts[0] if t < 256).find(b"Python") >= 0 else "planner"
        texts = self.script[role]
        out = []
        for i, _ in enumerate(prompts):
            text = texts[i % len(texts)]
            ids = [min(ord(c), 255) for c in text[: params.max_new_tokens]]
            finished = len(text) <= params.max_new_tokens
            out.append(Generation(ids, [-1.0] * len(ids), text, finished))
        return out

    def sync_weights(self) -> None:
        return None

    def sleep(self) -> None:
        return None

    def wake_up(self) -> None:
        return None


def _encode(messages: list[dict[str, str]]) -> list[int]:
    return list("\n".join(m["content"] for m in messages).encode("utf-8", "replace"))


def _plan_path(n: int) -> list[PlanPathEnv]:
    envs = []
    for seed in range(n):
        env = PlanPathEnv(PlanPathConfig(grid_size=4, wall_ratio=0.1, workflow="mas", max_turns=2))
        env.reset(seed=seed)
        envs.append(env)
    return envs


def test_the_rollout_records_cut_responses_and_penalises_the_planner_by_length() -> None:
    # The planner's cap is 8 tokens, its buffer 4 (no penalty up to 4 tokens), factor 0.5:
    # "Moves: U" (8 tokens, ended) 0.5 x -(8 - 4) / 4 = -0.5, the penalty goes by length;
    # "Moves: D R" (10, cut to 8) -0.5; "Moves:" (6) 0.5 x -(6 - 4) / 4 = -0.25; "R" (1) 0.
    expected = {"Moves: U": (-0.5, False), "Moves: D R": (-0.5, True), "Moves:": (-0.25, False)}
    expected["R"] = (0.0, False)
    gen = CuttingGenerator({"tool": ['```python\nprint("U")\n```'], "planner": list(expected)})
    truncation = TruncationSettings(Truncation.OVERLONG_PENALTY, 4, 0.5)
    settings = rollout_settings({"tool": 64, "planner": 8}, 4, truncation={"planner": truncation})
    with ThreadPoolExecutor(2) as pool:
        rollout = collect_rollout(
            _plan_path(2), [0, 1], generators={"shared": gen},
            policy_of={"tool": "shared", "planner": "shared"}, encode=_encode,
            settings=settings, pool=pool,
        )  # fmt: skip
    planner = [s for s in rollout.samples if s.agent_id == "planner"]
    assert planner and {s.response_text for s in planner} == set(expected)
    for s in planner:
        penalty, cut = expected[s.response_text]
        assert (s.overlong_penalty, s.truncated) == (penalty, cut), s.response_text
        # In the sample's own reward, not in the team term (the team's standing is shared).
        assert s.reward == pytest.approx(0.7 * s.team_reward + s.local_reward + penalty)
    for s in rollout.samples:
        if s.agent_id == "tool":  # keep, the default: not cut, no penalty
            assert (s.overlong_penalty, s.truncated) == (0.0, False)
            assert s.reward == pytest.approx(0.7 * s.team_reward + s.local_reward)
    metrics = rollout_metrics(rollout)
    assert metrics["rollout/planner/truncated_frac"] == 0.25  # one text of four is cut
    assert metrics["rollout/tool/truncated_frac"] == 0.0


# ---------------------------------------------------------------------------------------------
# mask: out of the loss and its normalisers


def _policy(tmp_path: Path) -> Policy:
    return build_policy(load_config(TINY, [f"run.output_dir={tmp_path}"]))


def _samples(policy: Policy, advantages: list[float]) -> list[Sample]:
    """One sampled response per advantage, to two prompts of different lengths."""
    tok = policy.tokenizer
    prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in ("Moves?", "Go: R")]
    batch = [prompts[k % 2] for k in range(len(advantages))]
    torch.manual_seed(0)
    engine = HFGenerator(policy.model, tok, share_prefill=True)
    gens = engine.generate(batch, SamplingParams(6, 1.0, 0, 1.0))
    return [
        Sample(0, 0, "planner", 0, k, "shared", p, g.token_ids, g.logprobs, 0.0, 0.0, 0.0, True,
               advantage=a)
        for k, (p, g, a) in enumerate(zip(batch, gens, advantages, strict=True))
    ]  # fmt: skip


def _gradients(
    policy: Policy, samples: list[Sample], settings: UpdateSettings
) -> tuple[list[torch.Tensor], UpdateStats]:
    """The gradient the optimizer would step with (the step itself not taken), and the stats."""
    captured: list[torch.Tensor] = []

    def capture(*args: object, **kwargs: object) -> None:
        captured.extend(p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                        for p in policy.params)  # fmt: skip

    policy.optimizer.step = capture  # type: ignore[method-assign]
    with warnings.catch_warnings():  # torch notices the replaced step
        warnings.simplefilter("ignore", UserWarning)
        stats = ppo_update(policy, samples, settings)
    assert not stats.skipped, stats.reason
    return captured, stats


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, atol=1e-7, rtol=1e-5) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("aggregation", [LossAggregation.TOKEN_MEAN, LossAggregation.SEQ_MEAN])
@pytest.mark.parametrize("share_prefix", [True, False])
def test_mask_equals_the_update_without_the_cut_samples(
    tmp_path: Path, aggregation: LossAggregation, share_prefix: bool
) -> None:
    policy = _policy(tmp_path)
    samples = _samples(policy, [1.0, -1.0, 0.5, 0.0, -0.5, 0.0])
    samples[0].truncated = samples[3].truncated = True  # one with signal, one without
    kept = [s for s in samples if not s.truncated]
    base = dataclasses.replace(BASE, aggregation=aggregation, share_prefix=share_prefix)
    mask = dataclasses.replace(base, masked=frozenset({"planner"}))
    masked, masked_stats = _gradients(policy, samples, mask)
    without, without_stats = _gradients(policy, kept, base)
    assert _same(masked, without)
    # The normalisers did not count the cut ones: the same counts as without them.
    counts = (masked_stats.num_samples, masked_stats.num_tokens)
    assert counts == (without_stats.num_samples, without_stats.num_tokens)
    assert counts == (4, sum(len(s.response_ids) for s in kept))
    assert masked_stats.computed_samples == 3  # skipping still leaves out the zero advantage
    # keep (the default: no agent masked) trains on them.
    everything, _ = _gradients(policy, samples, base)
    assert not _same(everything, without)


def test_mask_per_agent_and_a_batch_of_only_cut_responses_does_not_step(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    samples = _samples(policy, [1.0, -1.0])
    for s in samples:
        s.truncated = True
    only_tool = dataclasses.replace(BASE, masked=frozenset({"tool"}))
    assert not ppo_update(policy, samples, only_tool).skipped  # the planner keeps its
    before = [p.detach().clone() for p in policy.params]
    planner = dataclasses.replace(BASE, masked=frozenset({"planner"}))
    stats = ppo_update(policy, samples, planner)
    assert stats.skipped and stats.reason == "no samples with signal" and stats.num_samples == 0
    assert all(torch.equal(b, p) for b, p in zip(before, policy.params, strict=True))


class ThreadRanks:
    """``all_reduce`` over threads, each a rank (as in test_distributed.py)."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size)
        self.slots: list[Any] = [None] * world_size

    def all_reduce(self, rank: int) -> Callable[[torch.Tensor], None]:
        def reduce(tensor: torch.Tensor) -> None:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0])
            self.barrier.wait()
            tensor.copy_(total)

        return reduce


def test_two_ranks_with_masked_samples_take_the_step_without_them(tmp_path: Path) -> None:
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}"])
    single, ranks = build_policy(cfg), [build_policy(cfg), build_policy(cfg)]
    samples = mixed_batch(single)
    samples[1].truncated = samples[4].truncated = True  # one on each rank's shard
    want = ppo_update(single, [s for s in samples if not s.truncated], BASE)
    world, shards = ThreadRanks(2), [samples[0::2], samples[1::2]]
    got: list[Any] = [None, None]

    def run(rank: int) -> None:
        group = DataParallel(world.all_reduce(rank), rank, 2)
        got[rank] = ppo_update(ranks[rank], shards[rank], MASK, group)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (got[0].num_samples, got[0].num_tokens) == (want.num_samples, want.num_tokens)
    assert got[0].loss == pytest.approx(want.loss, abs=1e-6)
    expected = single.model.state_dict()
    for rank in ranks:
        for name, tensor in rank.model.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Config, metric and report


def test_truncation_settings_resolve_per_agent_and_a_too_long_buffer_names_its_key() -> None:
    cfg = load_config(TINY, ["rollout.truncation=overlong_penalty"])  # tool 24, planner 1 token
    tool, planner = cfg.rollout.agent("tool").truncation, cfg.rollout.agent("planner").truncation
    assert (tool.overlong_buffer, planner.overlong_buffer) == (4, 1)  # a fifth, at least 1
    assert tool.mode is planner.mode is Truncation.OVERLONG_PENALTY
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["rollout.truncation=overlong_penalty", "rollout.overlong_buffer=8"])
    message = str(info.value)
    assert message.startswith("invalid value for 'rollout.overlong_buffer': the overlong buffer")
    assert "agent 'planner'" in message and "\n" not in message
    fixed = load_config(
        TINY,
        [
            "rollout.truncation=overlong_penalty",
            "rollout.overlong_buffer=8",
            "rollout.agents.planner.truncation=mask",
        ],
    )
    assert fixed.rollout.agent("planner").truncation.mode is Truncation.MASK
    assert fixed.rollout.agent("tool").truncation.overlong_buffer == 8
    # The update masks the cut responses of the agents whose own setting is mask, and only those.
    agents = ("tool", "planner")
    assert update_settings(fixed, agents).masked == {"planner"}
    back = load_config(TINY, ["rollout.truncation=mask", "rollout.agents.planner.truncation=keep"])
    assert update_settings(back, agents).masked == {"tool"}


def test_truncated_frac_metric_and_its_report_curve(tmp_path: Path) -> None:
    def sample(agent: str, cut: bool) -> Sample:
        return Sample(0, 0, agent, 0, 0, "shared", [1], [2, 3], [-1.0, -1.0], 0.0, 0.0, 0.0,
                      True, truncated=cut)  # fmt: skip

    samples = [sample("tool", True), sample("tool", False), sample("tool", False)]
    samples += [sample("planner", True), sample("planner", True)]
    metrics = rollout_metrics(Rollout(samples, [EpisodeResult(0, 0, False, 1, 0.0)]))
    assert metrics["rollout/tool/truncated_frac"] == pytest.approx(1 / 3)
    assert metrics["rollout/planner/truncated_frac"] == 1.0

    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": step, "rollout/success": 0.0, "reward/tool/mean": 0.0, "reward/planner/mean": 0.0,
         "rollout/tool/truncated_frac": 0.1 * step, "rollout/planner/truncated_frac": 0.5}
        for step in (1, 2, 3)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot = next(p for p in plots_of([run]).plots if p.key == "truncated")
    assert plot.labels == ["tool", "planner"]
