"""Distinct prompts sharing a prefix: grouped, laid out in two blocks, prefilled once
(atgrpo.generation.prefixes), sampling what a plain prefill samples."""

from __future__ import annotations

import pytest
import torch

from atgrpo.attention import register
from atgrpo.generation import HFGenerator
from atgrpo.generation.prefixes import (
    MIN_SHARED,
    SharedPrefix,
    positions,
    prefix_groups,
    two_blocks,
    worth_sharing,
)
from atgrpo.models import build_tiny_model
from test_generation import _forward_logits, _recorded, _reference_logprobs

OFF = {"top_k": 0, "top_p": 1.0}
TOLERANCE = 1e-5  # fp32


def _sorted(groups: list[SharedPrefix]) -> list[tuple[int, list[int]]]:
    return sorted((g.length, sorted(g.members)) for g in groups)


def test_groups_skip_the_most_prefill_tokens() -> None:
    shared = list(range(100, 100 + MIN_SHARED + 4))  # 20 tokens
    a, b, c = [*shared, 1, 2], [*shared, 1, 3, 4], [*shared, 5]
    other = list(range(300, 330))
    short = [*shared[:3], 9]  # shares 3 tokens only: alone
    groups = prefix_groups([a, other, b, short, c])
    assert _sorted(groups) == [(4, [3]), (20, [0, 2, 4]), (30, [1])]  # alone: its whole prompt
    # A prompt that would shorten a group's prefix too much stays apart: one sharing 16 tokens
    # with 4 prompts that share 40 would skip 4 x 16 = 64 instead of 3 x 40 = 120 (it sorts
    # first, so a greedy pass would have grouped all five over 16).
    long = list(range(500, 540))
    fifth = [*long[:16], 7]
    groups = prefix_groups([*([*long, i] for i in range(4)), fifth])
    assert _sorted(groups) == [(17, [4]), (40, [0, 1, 2, 3])]
    # One sharing 35 of them joins: 4 x 35 = 140 > 3 x 40.
    groups = prefix_groups([*([*long, i] for i in range(4)), [*long[:35], 7]])
    assert _sorted(groups) == [(35, [0, 1, 2, 3, 4])]


def test_worth_sharing_needs_a_share_of_the_tokens_skipped() -> None:
    prompts = [[*list(range(40)), i] for i in range(3)]
    assert worth_sharing(prefix_groups(prompts), prompts)  # skips 80 of 123
    alone = [list(range(i * 50, i * 50 + 40)) for i in range(3)]
    assert not worth_sharing(prefix_groups(alone), alone)


def test_the_two_blocks_by_hand() -> None:
    prompts = [[7, 8, 9, 1], [7, 8, 9, 2, 3], [4, 5]]
    groups = [SharedPrefix(3, [0, 1]), SharedPrefix(2, [2])]
    blocks = two_blocks(prompts, groups, pad_id=0)
    assert blocks.prefix_ids.tolist() == [[7, 8, 9], [0, 4, 5]]
    assert blocks.prefix_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert blocks.group_of.tolist() == [0, 0, 1]
    assert blocks.rest_ids.tolist() == [[0, 1], [2, 3], [0, 0]]
    assert blocks.mask.tolist() == [[1, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    # Every real token at its place in its own prompt.
    assert positions(blocks.mask).tolist() == [[0, 1, 2, 0, 3], [0, 1, 2, 3, 4], [0, 0, 1, 0, 0]]


@pytest.fixture(scope="module")
def tiny() -> tuple[object, object]:
    model, tok = build_tiny_model(seed=0)
    model.set_attn_implementation(register())  # atgrpo's attention, as models.load_model loads
    tok.padding_side = "left"
    return model, tok


def _branches(tok) -> list[list[int]]:
    """Two tasks' prompts, each asked of three branches that differ at the end (different
    lengths), every distinct prompt twice (K = 2), and one prompt that shares nothing."""
    encode = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = encode("shared instructions first, ")
    tasks = [encode(f"then the task, {t}, described at some length as tasks are: ") for t in "ab"]
    assert len(head) >= MIN_SHARED and min(len(t) for t in tasks) > len(head)
    tails = ["one", "a longer second tail", "3"]
    prompts = [head + task + encode(tail) for task in tasks for tail in tails]
    return [p for p in prompts for _ in range(2)] + [encode("x y")]


@pytest.mark.parametrize("held", [True, False])  # prompts held once while decoding, or copied
@pytest.mark.parametrize("kw", [{"temperature": 1.0, **OFF}, {"temperature": None, **OFF}])
def test_a_shared_prefix_samples_what_a_plain_prefill_does(tiny, held: bool, kw: dict) -> None:
    model, tok = tiny
    prompts = _branches(tok)
    runs = {
        share: _recorded(
            model,
            HFGenerator(model, tok, share_prefill=share, prompt_once=held),
            prompts,
            max_new_tokens=10,
            **kw,
        )
        for share in (False, True)
    }
    (plain, _), (shared, forwards) = runs[False], runs[True]
    # The two passes ran: 3 groups' prefixes (two tasks, the lone prompt), then 7 prompts' rests.
    assert [f.shape[0] for f in forwards[:2]] == [3, 7] and forwards[1].cached > 0
    for a, b in zip(plain, shared, strict=True):
        assert (b.token_ids, b.finished) == (a.token_ids, a.finished) and b.token_ids
        if kw["temperature"] is not None:
            diff = torch.tensor(b.logprobs) - torch.tensor(a.logprobs)
            assert diff.abs().max() < TOLERANCE
    if kw["temperature"] is None:
        return
    # The recorded log-probs are those of the training forward's distribution.
    for logits, o in zip(_forward_logits(model, tok, prompts, shared), shared, strict=True):
        want = _reference_logprobs(logits, 1.0, 0, 1.0).gather(
            -1, torch.tensor(o.token_ids)[:, None]
        )
        assert (torch.tensor(o.logprobs) - want.squeeze(-1)).abs().max() < TOLERANCE
