"""Prefix-shared groups in the update: the same loss and gradients as recomputing every prompt."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

from atgrpo.algo.loss import LossAggregation
from atgrpo.algo.policy import Policy
from atgrpo.algo.prefix import (
    PackPlan,
    by_prompt,
    pack_responses,
    response_states_on_prompts,
    run_prompts,
)
from atgrpo.algo.records import Sample
from atgrpo.algo.update import UpdateSettings, UpdateStats, ppo_update
from atgrpo.config import load_config
from atgrpo.policies import build_policies
from conftest import REPO
from helpers import UPDATE_DEFAULTS

CONFIGS = REPO / "configs"
# No gradient clipping: a clipped gradient would hide a difference of scale.
SHARED = UpdateSettings(
    1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.0, 4, 1e9, **UPDATE_DEFAULTS
)
UNSHARED = dataclasses.replace(SHARED, share_prefix=False)


def _policy(tmp_path: Path, config: str, *overrides: str) -> Policy:
    cfg = load_config(CONFIGS / config, [f"run.output_dir={tmp_path}", *overrides])
    return next(iter(build_policies(cfg).values()))


def _groups(policy: Policy, prompt_lengths: tuple[int, ...], k: int) -> list[Sample]:
    """K responses of different lengths to each of several prompts of different lengths."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for g, p in enumerate(prompt_lengths):
        prompt = torch.randint(3, 250, (p,), generator=gen).tolist()
        for b in range(k):
            r = 1 + (g + 2 * b) % 6  # 1..6 tokens, a one-token response among them
            response = torch.randint(3, 250, (r,), generator=gen).tolist()
            advantage = float(torch.randn((), generator=gen))
            samples.append(
                Sample(g, g, "planner", 0, b, policy.policy_id, prompt, response, [-5.0] * r,
                       0.0, 0.0, 0.0, True, advantage=advantage)
            )  # fmt: skip
    return samples


def _step(
    policy: Policy, samples: list[Sample], settings: UpdateSettings
) -> tuple[UpdateStats, list[torch.Tensor]]:
    """The update's statistics and the gradient it would step with (the step not taken)."""
    grads: list[torch.Tensor] = []

    def capture(*args: object, **kwargs: object) -> None:
        grads.extend(p.grad.clone() for p in policy.params if p.grad is not None)

    policy.optimizer.step = capture  # type: ignore[method-assign]
    with warnings.catch_warnings():  # torch notices the replaced step
        warnings.simplefilter("ignore", UserWarning)
        stats = ppo_update(policy, samples, settings)
    assert not stats.skipped, stats.reason
    assert len(grads) == len(policy.params)
    return stats, grads


def _assert_same(
    policy: Policy, samples: list[Sample], shared: UpdateSettings, atol: float = 1e-5
) -> UpdateStats:
    unshared = dataclasses.replace(shared, share_prefix=False)
    got, got_grads = _step(policy, samples, shared)
    want, want_grads = _step(policy, samples, unshared)
    assert got.loss == pytest.approx(want.loss, abs=atol)
    assert got.pg_loss == pytest.approx(want.pg_loss, abs=atol)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=atol, rtol=1e-4)
    assert max(float(w.abs().max()) for w in want_grads) > 1e-4  # a real gradient
    return got


@pytest.mark.parametrize("aggregation", list(LossAggregation))
def test_shared_prompts_give_the_unshared_loss_and_gradients(
    tmp_path: Path, aggregation: LossAggregation
) -> None:
    policy = _policy(tmp_path, "tiny.yaml")
    samples = _groups(policy, prompt_lengths=(5, 17, 11), k=3)  # one micro-batch holds 2 groups
    stats = _assert_same(policy, samples, dataclasses.replace(SHARED, aggregation=aggregation))
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-6)  # trainer old log-probs: ratio 1


def test_the_prompts_of_a_micro_batch_run_in_one_forward(tmp_path: Path) -> None:
    """Three groups' prompts (lengths 5, 17, 11) in one left-padded forward, then micro-batches
    of responses that mix groups, packed: at most 3 forwards, not 3 prompts + 3 groups' chunks,
    and no response position is padding."""
    policy = _policy(tmp_path, "tiny.yaml")
    samples = _groups(policy, prompt_lengths=(5, 17, 11), k=3)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    handle = policy.model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append((kw["input_ids"], kw["attention_mask"])), with_kwargs=True
    )
    try:
        _step(policy, samples, SHARED)
    finally:
        handle.remove()
    assert calls[0][0].shape == (3, 17)  # the three prompts, left-padded to the longest
    # 9 responses (1-6 tokens) in micro-batches of 4 (4, 4, 1) that mix the groups; a batch
    # of one-token responses needs no forward (the prompts' last logits predict them).
    responses = calls[1:]
    assert 2 <= len(responses) <= 3
    assert all(ids.shape[0] <= 3 and mask.ndim == 4 for ids, mask in responses)  # per prompt
    # A real position sees itself (the diagonal of the responses' block); padding does not.
    real = sum(
        int(m[:, 0, :, -ids.shape[1] :].diagonal(dim1=-2, dim2=-1).sum()) for ids, m in responses
    )
    assert real == sum(len(s.response_ids) - 1 for s in samples)  # every input token once


def test_packed_responses_layout(tmp_path: Path) -> None:
    """Two prompts' responses packed: each prompt's responses back to back in its own row, with
    positions after the prompt, a mask of the prompt and the same response's earlier tokens, and
    an index that puts each state back at its response token."""
    policy = _policy(tmp_path, "tiny.yaml")
    prompts = run_prompts(policy.model, [[5, 6, 7], [8, 9]], 0, None)
    rows = torch.tensor([0, 1, 0])
    ids = torch.tensor([[11, 12, 13], [21, 22, 0], [31, 0, 0]])
    layout = pack_responses(prompts, rows, ids, PackPlan.of(rows, (ids > 0).long()))
    assert layout.prompt_rows.tolist() == [0, 1]
    assert layout.ids.tolist() == [[11, 12], [21, 0]]  # 2 + 0 and 1 input tokens
    assert layout.positions[0].tolist() == [3, 4] and layout.positions[1, 0] == 2
    whole, left_padded = [True] * 3, [False, True, True]  # prompt 1 has 2 tokens of 3
    assert layout.mask[:, 0, :, :3].tolist() == [[whole, whole], [left_padded, left_padded]]
    assert layout.mask[:, 0, :, 3:].tolist() == [
        [[True, False], [True, True]],
        [[True, False], [False, False]],  # the padding query sees no response token
    ]
    # the table: 2 prompts' last states, then the 2 x 2 packed positions, then a zero row (6)
    assert layout.index.tolist() == [[0, 2, 3], [1, 4, 6], [0, 6, 6]]


def test_packing_is_taken_only_where_it_runs_fewer_positions(tmp_path: Path) -> None:
    """Three responses of one prompt and one of another, all of 4 tokens: packed rows of 9 and
    3 inputs padded to 9 (18 positions) against 4 padded rows of 3 (12): padded rows run."""
    policy = _policy(tmp_path, "tiny.yaml")
    prompts = run_prompts(policy.model, [[5, 6, 7], [8, 9]], 0, None)
    ids = torch.full((4, 4), 11)
    masks: list[tuple[int, ...]] = []
    handle = policy.model.register_forward_pre_hook(
        lambda _m, _a, kw: masks.append(tuple(kw["attention_mask"].shape)), with_kwargs=True
    )
    try:
        for rows in ([0, 0, 0, 1], [0, 0, 1, 1]):  # 18 against 12; 12 against 12
            response_states_on_prompts(
                policy.model, prompts, torch.tensor(rows), ids, torch.ones_like(ids), None
            )
        lengths = torch.tensor([[1, 1, 1], [1, 0, 0]])  # 2 + 0 inputs: 2 packed against 4
        response_states_on_prompts(
            policy.model, prompts, torch.tensor([0, 0]), ids[:2, :3], lengths, None
        )
    finally:
        handle.remove()
    assert masks == [(4, 6), (4, 6), (1, 1, 2, 5)]


def test_an_attention_without_boolean_masks_runs_padded_rows_alike(tmp_path: Path) -> None:
    """Eager attention adds its mask to the scores, so a packed layout's boolean mask would be
    misread: there each response is a padded row, with the same loss and gradients."""
    policy = _policy(tmp_path, "tiny.yaml")
    policy.model.set_attn_implementation("eager")
    masks: list[int] = []
    handle = policy.model.register_forward_pre_hook(
        lambda _m, _a, kw: masks.append(kw["attention_mask"].ndim), with_kwargs=True
    )
    try:
        _assert_same(policy, _groups(policy, prompt_lengths=(5, 17, 11), k=3), SHARED)
    finally:
        handle.remove()
    assert masks and set(masks) == {2}


def test_a_group_split_into_response_chunks_over_one_cached_prompt(tmp_path: Path) -> None:
    policy = _policy(tmp_path, "tiny.yaml")
    samples = _groups(policy, prompt_lengths=(9, 13), k=5)
    _assert_same(policy, samples, dataclasses.replace(SHARED, micro_batch_size=2))  # 3 chunks


def test_shared_prompts_train_a_lora_policy_alike(tmp_path: Path) -> None:
    policy = _policy(tmp_path, "tiny-lora.yaml")
    assert policy.adapter is not None
    with torch.no_grad():  # a fresh adapter has B = 0, so A would get no gradient
        for p in policy.params:
            p.add_(0.1 * torch.randn_like(p))
    _assert_same(policy, _groups(policy, prompt_lengths=(7, 12), k=3), SHARED)


def test_with_entropy_and_kl_terms(tmp_path: Path) -> None:
    policy = _policy(tmp_path, "tiny.yaml", "algo.kl_coef=0.1")
    with torch.no_grad():  # move away from the reference so the KL term has a gradient
        for p in policy.params:
            p.add_(0.01 * torch.randn_like(p))
    settings = dataclasses.replace(SHARED, kl_coef=0.1, entropy_coef=0.01)
    stats = _assert_same(policy, _groups(policy, prompt_lengths=(6, 10), k=3), settings)
    assert stats.kl > 0.0 and stats.entropy > 0.0


def test_under_bf16_autocast_the_ratio_is_one_and_gradients_agree(tmp_path: Path) -> None:
    policy = _policy(tmp_path, "tiny.yaml", "model.precision=bf16_autocast")
    assert policy.autocast_dtype is torch.bfloat16
    samples = _groups(policy, prompt_lengths=(8, 14), k=3)
    shared, shared_grads = _step(policy, samples, SHARED)
    _, unshared_grads = _step(policy, samples, UNSHARED)
    assert shared.ratio_mean == pytest.approx(1.0, abs=1e-3) and shared.clip_frac == 0.0
    # bf16 rounds the two computations differently: compare the whole gradient's direction
    # and size (elementwise, a few of the smallest entries differ by more than 1 %).
    got = torch.cat([g.flatten() for g in shared_grads])
    want = torch.cat([w.flatten() for w in unshared_grads])
    print(f"bf16: relative error {float((got - want).norm() / want.norm()):.2e}")
    assert float((got - want).norm() / want.norm()) < 2e-2
    assert float(torch.nn.functional.cosine_similarity(got, want, dim=0)) > 0.999


def test_prompt_groups_keep_identical_prompts_together() -> None:
    def s(prompt: list[int]) -> Sample:
        return Sample(0, 0, "a", 0, 0, "p", prompt, [1], [0.0], 0.0, 0.0, 0.0, True)

    a, b, c = s([1, 2]), s([1, 2, 3]), s([1, 2])
    assert by_prompt([a, b, c]) == [[a, c], [b]]
