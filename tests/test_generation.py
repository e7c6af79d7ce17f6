"""The HF backend samples what it is asked to and records that distribution's log-probs.

Top-k / top-p off: the tempered softmax over the whole vocabulary, whatever the model's own
generation config says (transformers 5 would fill unset fields from it; a Qwen3-style config
has top-k 20). On: the tempered, truncated, renormalised distribution (docs/algorithm.md).
The inverse-CDF draw matches its distribution and never draws an impossible token. A shared
prefill (each distinct prompt run once) samples what prefilling every copy does.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch

from atgrpo.algo.collate import collate, response_logits
from atgrpo.algo.loss import token_logprobs
from atgrpo.algo.records import Sample
from atgrpo.generation import Generation, HFGenerator, SamplingParams
from atgrpo.generation.hf import distinct_rows
from atgrpo.generation.sampler import process_logits
from atgrpo.generation.sampler import sample_inverse_cdf as draw
from atgrpo.models import build_tiny_model

# A Qwen3-style generation_config.json, plus processors that would act under greedy decoding.
QWEN3_STYLE = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
HOSTILE = {
    **QWEN3_STYLE,
    "repetition_penalty": 1.5,
    "no_repeat_ngram_size": 2,
    "min_new_tokens": 6,
    "min_p": 0.1,
    "typical_p": 0.5,
}
OFF = {"top_k": 0, "top_p": 1.0}
TOLERANCE = 1e-5  # fp32: generation with a KV cache vs one training forward
INF = math.inf


@pytest.fixture(scope="module")
def tiny() -> tuple[object, object]:
    model, tok = build_tiny_model(seed=0)
    tok.padding_side = "left"
    return model, tok


def _with_generation_config(monkeypatch, model, fields: dict) -> None:
    config = copy.deepcopy(model.generation_config)
    for name, value in fields.items():
        setattr(config, name, value)
    monkeypatch.setattr(model, "generation_config", config)  # restored after the test


def _prompts(tok) -> list[list[int]]:
    text = ["a longer prompt here", "Moves?", "x"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in text] + [[65, 66]]


def _forward_logits(model, tok, prompts, outs: list[Generation]) -> list[torch.Tensor]:
    """Per response, the (R, V) logits of one training forward over prompt + response."""
    samples = [
        Sample(0, 0, "a", 0, k, "shared", p, o.token_ids, o.logprobs, 0, 0, 0, True)
        for k, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]
    batch = collate(samples, tok.pad_token_id)
    with torch.no_grad():
        logits = response_logits(model, batch, None)  # (B, R, V)
    return [logits[i, : len(o.token_ids)] for i, o in enumerate(outs)]


def _reference_logprobs(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """Tempered, top-k, then top-p, renormalised, written out row by row: (R, V)."""
    out = torch.full_like(logits, -INF)
    for r, row in enumerate(logits.double() / t):
        order = row.argsort(descending=True)
        keep = order[:k] if k > 0 else order
        probs = row[keep].softmax(-1)  # descending, renormalised over the top-k
        if p < 1.0:
            n = int((probs.cumsum(-1) < p).sum()) + 1  # the first n reach p
            keep, probs = keep[:n], probs[:n] / probs[:n].sum()
        out[r, keep] = probs.log().to(out.dtype)
    return out


def _sample(gen: HFGenerator, prompts, n: int, **kw) -> list[Generation]:
    torch.manual_seed(0)
    return gen.generate(prompts * n, SamplingParams(max_new_tokens=12, **kw))


# -- the processing alone, by hand -------------------------------------------------------------


def _scores(weights: list[float]) -> torch.Tensor:
    # logits = 2 log(w): at temperature 2 the probabilities are w / sum(w), at 1 w^2 / sum(w^2).
    return (2 * torch.tensor(weights, dtype=torch.float64).log()).float().unsqueeze(0)  # (1, 5)


def _logs(*probs: float | None) -> list[float]:
    return [math.log(x) if x is not None else -INF for x in probs]


@pytest.mark.parametrize(
    ("t", "k", "p", "expected"),
    [
        # Weights 2 4 1 3 1 (sum 11) at T=2; nothing cut: log(w / 11).
        (2.0, 0, 1.0, _logs(2 / 11, 4 / 11, 1 / 11, 3 / 11, 1 / 11)),
        # Temperature 1 squares the weights: 4 16 1 9 1 (sum 31).
        (1.0, 0, 1.0, _logs(4 / 31, 16 / 31, 1 / 31, 9 / 31, 1 / 31)),
        # k >= V is off.
        (2.0, 7, 1.0, _logs(2 / 11, 4 / 11, 1 / 11, 3 / 11, 1 / 11)),
        # Top-2: tokens 1 and 3 (4 + 3 = 7).
        (2.0, 2, 1.0, _logs(None, 4 / 7, None, 3 / 7, None)),
        # Top-p 0.65 on 4 3 2 1 1 / 11: mass above token 0 is 7/11 = .64 < .65 (kept), above
        # the 1s it is 9/11 (cut): tokens 1 3 0, renormalised over 9.
        (2.0, 0, 0.65, _logs(2 / 9, 4 / 9, None, 3 / 9, None)),
        # Top-3 first (4 3 2 / 9), then top-p 0.75 on that: above token 0 is 7/9 = .78 >= .75,
        # cut. (On the full distribution it would be 7/11 and kept: top-p sees top-k's result.)
        (2.0, 3, 0.75, _logs(None, 4 / 7, None, 3 / 7, None)),
        # A tiny top-p keeps the most likely token alone.
        (2.0, 0, 0.01, _logs(None, 1.0, None, None, None)),
    ],
)
def test_process_logits_by_hand(t: float, k: int, p: float, expected: list[float]) -> None:
    got = process_logits(_scores([2, 4, 1, 3, 1]), t, k, p)
    assert got.shape == (1, 5) and got.dtype == torch.float32
    assert got[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_process_logits_top_k_keeps_k_tokens_on_ties() -> None:
    scores = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])
    got = process_logits(scores, 1.0, 2, 1.0)
    assert int(got.isfinite().sum()) == 2  # exactly torch.topk's two, not all three tied
    assert got.exp().sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.0, **OFF},
        {"temperature": 1.0, "top_k": -1, "top_p": 1.0},
        {"temperature": 1.0, "top_k": 0, "top_p": 0.0},
        {"temperature": 1.0, "top_k": 0, "top_p": 1.5},
    ],
)
def test_settings_that_define_no_distribution_are_refused(tiny, kw: dict) -> None:
    model, tok = tiny
    with pytest.raises(ValueError):
        HFGenerator(model, tok, share_prefill=True).generate(
            [[70]], SamplingParams(max_new_tokens=2, **kw)
        )


# -- sampling on the tiny model ----------------------------------------------------------------


def test_top_k_and_top_p_off_sample_the_whole_vocabulary(tiny, monkeypatch) -> None:
    """A Qwen3-style model config (top-k 20, top-p 0.95) must not cut what we sample.

    The tiny random model is close to uniform over its ~259 tokens, so most draws rank past 50
    under the model's own logits; under any top-k <= 50 (the model's 20, or transformers'
    default 50) none could.
    """
    model, tok = tiny
    _with_generation_config(monkeypatch, model, QWEN3_STYLE)
    prompts = _prompts(tok)
    outs = _sample(HFGenerator(model, tok, share_prefill=True), prompts, 4, temperature=1.0, **OFF)
    ranks = []
    for logits, o in zip(_forward_logits(model, tok, prompts * 4, outs), outs, strict=True):
        chosen = logits.gather(-1, torch.tensor(o.token_ids).unsqueeze(-1))  # (R, 1)
        ranks += (logits > chosen).sum(-1).tolist()  # 0: the most likely token
    assert len(ranks) > 100
    assert max(ranks) >= 50
    assert sum(r >= 20 for r in ranks) > len(ranks) / 2


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_off_are_the_full_tempered_softmax(
    tiny, monkeypatch, temperature: float, share: bool
) -> None:
    model, tok = tiny
    _with_generation_config(monkeypatch, model, HOSTILE)  # a penalty would change them
    prompts = _prompts(tok)
    gen = HFGenerator(model, tok, share_prefill=share)
    outs = _sample(gen, prompts, 2, temperature=temperature, **OFF)
    for logits, o in zip(_forward_logits(model, tok, prompts * 2, outs), outs, strict=True):
        assert len(o.logprobs) == len(o.token_ids) > 0
        targets = torch.tensor(o.token_ids).unsqueeze(0)
        want = token_logprobs(logits.unsqueeze(0), targets, temperature)[0]  # the training's
        assert (torch.tensor(o.logprobs) - want).abs().max() < TOLERANCE


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 10, 1.0), (1.0, 0, 0.3), (0.5, 12, 0.8)]
)
def test_logprobs_on_are_the_processed_distribution(
    tiny, monkeypatch, temperature: float, top_k: int, top_p: float, share: bool
) -> None:
    model, tok = tiny
    _with_generation_config(monkeypatch, model, HOSTILE)
    prompts = _prompts(tok)
    kw = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    outs = _sample(HFGenerator(model, tok, share_prefill=share), prompts, 2, **kw)
    sizes = []
    for logits, o in zip(_forward_logits(model, tok, prompts * 2, outs), outs, strict=True):
        ref = _reference_logprobs(logits, temperature, top_k, top_p)  # (R, V)
        ours = process_logits(logits, temperature, top_k, top_p)
        assert torch.equal(ours.isfinite(), ref.isfinite())  # the same kept sets
        want = ref.gather(-1, torch.tensor(o.token_ids).unsqueeze(-1)).squeeze(-1)  # (R,)
        assert want.isfinite().all()  # every sampled token lies inside its kept set
        assert (torch.tensor(o.logprobs) - want).abs().max() < TOLERANCE
        sizes += ref.isfinite().sum(-1).tolist()
    vocab = logits.shape[-1]
    assert max(sizes) < vocab and (top_k == 0 or max(sizes) <= top_k)  # something was cut


def test_top_k_one_is_greedy_with_log_prob_zero(tiny) -> None:
    model, tok = tiny
    gen = HFGenerator(model, tok, share_prefill=True)
    prompts = _prompts(tok)
    greedy = gen.generate(prompts, SamplingParams(max_new_tokens=8, temperature=None, **OFF))
    top1 = gen.generate(
        prompts, SamplingParams(max_new_tokens=8, temperature=0.9, top_k=1, top_p=1.0)
    )
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]
    assert all(lp == 0.0 for o in top1 for lp in o.logprobs)


def _argmax_decode(model, prompt: list[int], eos: int, steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == eos:
            break
    return ids[len(prompt) :]


def test_greedy_is_argmax_decoding_and_has_no_logprobs(tiny, monkeypatch) -> None:
    model, tok = tiny
    _with_generation_config(monkeypatch, model, HOSTILE)  # penalties would change the argmax
    gen = HFGenerator(model, tok, share_prefill=True)
    prompts = _prompts(tok)
    outs = gen.generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=None, top_k=5, top_p=0.5)
    )
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _argmax_decode(model, p, tok.eos_token_id, 10)
        assert o.logprobs == []
    again = gen.generate(prompts, SamplingParams(max_new_tokens=10, temperature=None, **OFF))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # top-k/p ignored


def test_a_model_config_we_cannot_neutralise_is_refused(tiny, monkeypatch) -> None:
    model, tok = tiny
    _with_generation_config(monkeypatch, model, {"suppress_tokens": [5]})
    with pytest.raises(ValueError, match="suppress_tokens"):
        HFGenerator(model, tok, share_prefill=True).generate(
            [[70]], SamplingParams(max_new_tokens=2, temperature=1.0, **OFF)
        )


def test_responses_stop_at_eos(tiny) -> None:
    model, tok = tiny
    gen = HFGenerator(model, tok, share_prefill=True)
    torch.manual_seed(1)
    outs = gen.generate([[70]] * 16, SamplingParams(max_new_tokens=40, temperature=1.0, **OFF))
    for o in outs:
        if o.finished:
            assert o.token_ids[-1] == tok.eos_token_id
            assert tok.eos_token_id not in o.token_ids[:-1]
        else:
            assert len(o.token_ids) == 40
        assert len(o.logprobs) == len(o.token_ids)
        assert all(lp <= 0.0 for lp in o.logprobs)


# -- the inverse-CDF draw ----------------------------------------------------------------------


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= the statistic) of counts against probs, with 2 or 3 degrees of freedom
    (survival functions in closed form: no scipy)."""
    kept = probs > 0
    expected = probs[kept] * counts.sum()
    x = float(((counts[kept] - expected) ** 2 / expected).sum())
    dof = int(kept.sum()) - 1
    if dof == 2:
        return math.exp(-x / 2)
    assert dof == 3
    return math.erfc((x / 2) ** 0.5) + (2 * x / math.pi) ** 0.5 * math.exp(-x / 2)


def _draw_counts(probs: torch.Tensor) -> torch.Tensor:  # (V,) -> (V,) counts of 100000 draws
    torch.manual_seed(0)
    tokens = torch.cat([draw(probs.expand(2000, len(probs))) for _ in range(50)])  # (1e5, 1)
    return torch.bincount(tokens.flatten(), minlength=len(probs)).double()


@pytest.mark.parametrize(
    "weights",
    [[1, 0, 4, 2, 3], [0, 1, 2, 1, 0]],  # the second: impossible tokens at both ends
)
def test_draw_matches_its_distribution(weights: list[int]) -> None:
    probs = torch.tensor(weights, dtype=torch.float32)  # unnormalised: draw renormalises
    counts = _draw_counts(probs)
    assert counts[probs == 0].sum() == 0  # an impossible token is never drawn
    p = probs.double() / probs.sum()
    assert _chi_square_p_value(counts, p) > 1e-4
    # Each frequency within 5 standard deviations of its binomial proportion.
    n = counts.sum()
    assert ((counts / n - p).abs() <= 5 * (p * (1 - p) / n).sqrt()).all()


def test_draw_across_blocks_of_the_vocabulary() -> None:
    """Mass spread over blocks (256 tokens) 1, 2 and 3 of 5; blocks 0 and 4 (partial) empty."""
    where, weights = [260, 511, 599, 1000], [1.0, 4.0, 2.0, 3.0]
    probs = torch.zeros(1100).index_put_((torch.tensor(where),), torch.tensor(weights))
    counts = _draw_counts(probs)
    assert counts.sum() == counts[where].sum()  # nothing else is ever drawn
    assert _chi_square_p_value(counts, probs.double() / probs.sum()) > 1e-4
    ends = torch.tensor([[0.0], [1.0 - 2.0**-53]], dtype=torch.float64)
    assert draw(probs.expand(2, 1100), ends).flatten().tolist() == [260, 1000]


def test_draw_at_the_ends_of_the_unit_interval() -> None:
    """u = 0 and the largest u < 1 land on the first and last possible tokens, not past them."""
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]] * 2)  # (2, 5)
    u = torch.tensor([[0.0], [1.0 - 2.0**-53]], dtype=torch.float64)
    assert draw(probs, u).flatten().tolist() == [1, 3]
    # A 1e-12 tail after a mass of 1 keeps its interval in a float64 CDF (float32 would round
    # 1 + 1e-12 to 1 and never draw it).
    tail = torch.tensor([[1.0, 0.0, 1e-12]])  # (1, 3)
    assert draw(tail, torch.tensor([[1.0 - 2.0**-53]], dtype=torch.float64)).item() == 2
    assert draw(tail, torch.tensor([[1.0 - 2.0**-30]], dtype=torch.float64)).item() == 0


# -- a shared prefill --------------------------------------------------------------------------


def _grouped(tok, k: int) -> list[list[int]]:
    """The rollout's order: K copies of each prompt in a row, then a prompt asked once."""
    prompts = _prompts(tok)  # 4 prompts, 1 to 20 tokens: every row but one is left-padded
    return [p for p in prompts[:3] for _ in range(k)] + [prompts[3]]


def test_distinct_rows() -> None:
    firsts, rows = distinct_rows([[1], [1], [2, 3], [1], [4], [2, 3]])
    assert firsts == [0, 2, 4] and rows == [0, 0, 1, 0, 2, 1]


@dataclass
class _Forward:
    """One forward of the model during generation."""

    shape: tuple[int, int]  # of input_ids: (rows, tokens)
    cached: int  # tokens already in the cache
    logits: torch.Tensor  # (rows, V) at the last position


def _recorded(model, gen: HFGenerator, prompts, **kw) -> tuple[list[Generation], list[_Forward]]:
    """Generate under seed 0, recording every forward of the model."""
    pending: list[tuple[tuple[int, int], int]] = []
    forwards: list[_Forward] = []

    def before(module, args, kwargs) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # by transformers version
        pending.append((tuple(kwargs["input_ids"].shape), cache.get_seq_length() if cache else 0))

    def after(module, args, out) -> None:
        forwards.append(_Forward(*pending.pop(), out.logits[:, -1].float()))

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after),
    ]
    try:
        torch.manual_seed(0)  # the same draws: one per step for the whole batch in both paths
        outs = gen.generate(prompts, SamplingParams(**kw))
    finally:
        for h in handles:
            h.remove()
    return outs, forwards


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1.0, **OFF},
        {"temperature": 0.7, "top_k": 12, "top_p": 0.9},
        {"temperature": None, **OFF},  # greedy
    ],
)
@pytest.mark.parametrize("max_batch_size", [None, 4])  # 4: chunks that split a prompt's copies
def test_shared_prefill_samples_what_the_unshared_one_does(
    tiny, kw: dict, max_batch_size: int | None
) -> None:
    model, tok = tiny
    prompts = _grouped(tok, 3)
    runs = {
        share: _recorded(
            model,
            HFGenerator(model, tok, share_prefill=share, max_batch_size=max_batch_size),
            prompts,
            max_new_tokens=12,
            **kw,
        )
        for share in (False, True)
    }
    (plain, plain_steps), (shared, shared_steps) = runs[False], runs[True]
    # Every step's next-token logits, prefills of the distinct prompts (empty cache) aside.
    shared_steps = [f for f in shared_steps if f.cached > 0]
    assert len(shared_steps) == len(plain_steps)
    for a, b in zip(plain_steps, shared_steps, strict=True):
        assert a.logits.shape == b.logits.shape
        assert (a.logits - b.logits).abs().max() < TOLERANCE
    for a, b in zip(plain, shared, strict=True):
        assert (b.token_ids, b.finished) == (a.token_ids, a.finished)
        assert len(b.logprobs) == len(a.logprobs)
        if kw["temperature"] is not None:
            diff = torch.tensor(b.logprobs) - torch.tensor(a.logprobs)
            assert diff.abs().max() < TOLERANCE
    if kw["temperature"] is None:
        return
    assert len({tuple(o.token_ids) for o in shared[:3]}) > 1  # the copies sample apart
    # And the log-probs are those of the training forward, as without sharing.
    t, k, p = kw["temperature"], kw["top_k"], kw["top_p"]
    for logits, o in zip(_forward_logits(model, tok, prompts, shared), shared, strict=True):
        want = _reference_logprobs(logits, t, k, p).gather(-1, torch.tensor(o.token_ids)[:, None])
        assert (torch.tensor(o.logprobs) - want.squeeze(-1)).abs().max() < TOLERANCE


def test_greedy_shared_prefill_is_argmax_decoding(tiny) -> None:
    model, tok = tiny
    prompts = _grouped(tok, 2)
    gen = HFGenerator(model, tok, share_prefill=True)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=10, temperature=None, **OFF))
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _argmax_decode(model, p, tok.eos_token_id, 10)


def test_shared_prefill_runs_each_distinct_prompt_once(tiny) -> None:
    model, tok = tiny
    prompts = _grouped(tok, 3)  # 10 rows, 4 distinct prompts, 20 tokens wide
    width = max(len(p) for p in prompts)
    kw = {"max_new_tokens": 4, "temperature": 1.0, **OFF}
    _, shared = _recorded(model, HFGenerator(model, tok, share_prefill=True), prompts, **kw)
    # The distinct prompts but their last token, then every row one token at a time.
    assert (shared[0].shape, shared[0].cached) == ((4, width - 1), 0)
    assert [(f.shape, f.cached) for f in shared[1:]] == [((10, 1), width - 1 + i) for i in range(4)]
    _, plain = _recorded(model, HFGenerator(model, tok, share_prefill=False), prompts, **kw)
    assert [f.shape for f in plain] == [(10, width)] + [(10, 1)] * 3


def test_a_cache_that_cannot_be_shared_is_refused(tiny, monkeypatch) -> None:
    model, tok = tiny
    _with_generation_config(monkeypatch, model, {"cache_implementation": "static"})
    with pytest.raises(ValueError, match=r"rollout\.share_prefill=false"):
        HFGenerator(model, tok, share_prefill=True)
    HFGenerator(model, tok, share_prefill=False)  # the unshared path does not need it
