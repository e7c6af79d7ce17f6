"""Log-probs without the full logits (atgrpo.algo.scores): the output layer applied a chunk of
positions at a time, under activation checkpointing, equals the full (B, R, V) computation in
values and gradients (fp32, 1e-6), through the update's unshared, prefix-shared and LoRA paths,
and no chunk holds more than its share of logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from atgrpo.algo.collate import collate, response_logits
from atgrpo.algo.loss import LossAggregation, entropy_from_logits, token_logprobs
from atgrpo.algo.policy import Policy
from atgrpo.algo.scores import final_states, output_layer, token_scores
from atgrpo.algo.update import UpdateSettings
from atgrpo.config import load_config
from atgrpo.policies import build_policies, build_policy
from conftest import REPO
from helpers import UPDATE_DEFAULTS, mixed_batch
from test_truncation import _gradients

TINY = REPO / "configs" / "tiny.yaml"
# An entropy term (so both scores are used) and a KL term (the reference's log-probs too).
BASE = UpdateSettings(
    1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.05, 0.01, 4, 1e9, **UPDATE_DEFAULTS
)


def test_chunks_equal_the_full_logits_in_values_and_gradients() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    states = torch.randn(3, 7, 8, requires_grad=True)  # (B, T, H)
    targets = torch.randint(50, (3, 7))
    temperature = torch.tensor([0.7, 1.0, 1.3])[:, None, None]  # each row its own
    full_logits = head(states)
    want_lp = token_logprobs(full_logits, targets, temperature)
    want_h = entropy_from_logits(full_logits, temperature)
    (want_lp.sum() + want_h.sum()).backward()
    want_grads = [states.grad.clone(), head.weight.grad.clone()]
    for chunk in (3, 6, 21, 10_000):  # 1 and 2 positions a chunk, one chunk, one chunk
        states.grad, head.weight.grad = None, None
        got = token_scores(states, head, targets, temperature, chunk, entropy=True)
        assert got.entropy is not None
        torch.testing.assert_close(got.logprobs, want_lp, atol=1e-6, rtol=0)
        torch.testing.assert_close(got.entropy, want_h, atol=1e-6, rtol=0)
        (got.logprobs.sum() + got.entropy.sum()).backward()
        torch.testing.assert_close(states.grad, want_grads[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(head.weight.grad, want_grads[1], atol=1e-6, rtol=0)
    assert token_scores(states, head, targets, 1.0, 3).entropy is None


def test_no_chunk_holds_more_than_its_share_of_logits() -> None:
    """The output layer sees at most chunk_tokens rows x positions at once, in the forward and
    again in the backward's recomputation, never the whole (B, T)."""
    head = torch.nn.Linear(8, 50, bias=False)
    seen: list[int] = []
    head.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[:2].numel()))
    states = torch.randn(4, 10, 8, requires_grad=True)
    got = token_scores(states, head, torch.zeros(4, 10, dtype=torch.long), 1.0, 8)
    got.logprobs.sum().backward()
    assert max(seen) == 8 and len(seen) == 2 * 5  # 2 positions x 4 rows; 5 chunks, twice


def test_the_model_returns_its_final_states_inside_and_its_head_after(tmp_path: Path) -> None:
    policy = build_policy(load_config(TINY, [f"run.output_dir={tmp_path}"]))
    batch = collate(mixed_batch(policy), policy.tokenizer.pad_token_id)
    head = output_layer(policy.model)
    with torch.no_grad():
        want = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        with pytest.raises(RuntimeError, match="boom"), final_states(policy.model):
            raise RuntimeError("boom")
        assert output_layer(policy.model) is head  # restored after an error too
        with final_states(policy.model):
            states = policy.model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask
            ).logits
    assert states.shape[-1] == policy.model.config.hidden_size
    torch.testing.assert_close(head(states), want, atol=1e-6, rtol=0)


def test_a_model_that_rescales_its_logits_is_refused(tmp_path: Path) -> None:
    policy = build_policy(load_config(TINY, [f"run.output_dir={tmp_path}"]))
    policy.model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"), final_states(policy.model):
        pass


def test_response_scores_match_the_full_logits_of_the_model(tmp_path: Path) -> None:
    from atgrpo.algo.collate import response_states
    from atgrpo.algo.logprobs import response_scores

    policy = build_policy(load_config(TINY, [f"run.output_dir={tmp_path}"]))
    batch = collate(mixed_batch(policy), policy.tokenizer.pad_token_id)
    r = batch.responses
    settings = dataclasses.replace(BASE, temperature=0.8, logprob_chunk_tokens=5)
    with torch.no_grad():
        want = token_logprobs(response_logits(policy.model, batch, None), r.targets, 0.8)
        states = response_states(policy.model, batch, None)
        got = response_scores(policy.model, states, r, settings, None).logprobs
    mask = r.mask.bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("config", "share_prefix"),
    [("tiny.yaml", False), ("tiny.yaml", True), ("tiny-lora.yaml", True)],
)
def test_the_update_takes_the_same_step_chunked_and_whole(
    tmp_path: Path, config: str, share_prefix: bool
) -> None:
    def policy() -> Policy:
        overrides = [f"run.output_dir={tmp_path}", "algo.kl_coef=0.05"]  # a reference copy
        cfg = load_config(REPO / "configs" / config, overrides)
        built = build_policies(cfg)
        return built["shared"] if "shared" in built else built["tool"]

    first = policy()
    samples = [dataclasses.replace(s, policy_id=first.policy_id) for s in mixed_batch(first)]
    grads = {}
    for chunk in (3, 10_000):  # 3 tokens: one position of 3 rows a chunk; else one chunk
        settings = dataclasses.replace(BASE, share_prefix=share_prefix, logprob_chunk_tokens=chunk)
        grads[chunk] = _gradients(first if chunk == 3 else policy(), samples, settings)
    (got, got_stats), (want, want_stats) = grads[3], grads[10_000]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for k in ("loss", "entropy", "kl"):
        assert getattr(got_stats, k) == pytest.approx(getattr(want_stats, k), abs=1e-6), k
