"""The HF backend samples what it is asked to and records that distribution's log-probs.

Top-k / top-p off: the tempered softmax over the whole vocabulary, whatever the model's own
generation config says (transformers 5 would fill unset fields from it; a Qwen3-style config
has top-k 20). On: the tempered, truncated, renormalised distribution (docs/algorithm.md).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from atgrpo.generation import Generation, HFGenerator
from atgrpo.generation.hf import process_logits
from atgrpo.loss import token_logprobs
from atgrpo.models import build_tiny_model
from atgrpo.records import Sample
from atgrpo.update import collate, response_logits

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
    return gen.generate(prompts * n, max_new_tokens=12, **kw)


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
        HFGenerator(model, tok).generate([[70]], max_new_tokens=2, **kw)


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
    outs = _sample(HFGenerator(model, tok), prompts, 4, temperature=1.0, **OFF)
    ranks = []
    for logits, o in zip(_forward_logits(model, tok, prompts * 4, outs), outs, strict=True):
        chosen = logits.gather(-1, torch.tensor(o.token_ids).unsqueeze(-1))  # (R, 1)
        ranks += (logits > chosen).sum(-1).tolist()  # 0: the most likely token
    assert len(ranks) > 100
    assert max(ranks) >= 50
    assert sum(r >= 20 for r in ranks) > len(ranks) / 2


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_off_are_the_full_tempered_softmax(tiny, monkeypatch, temperature) -> None:
    model, tok = tiny
    _with_generation_config(monkeypatch, model, HOSTILE)  # a penalty would change them
    prompts = _prompts(tok)
    outs = _sample(HFGenerator(model, tok), prompts, 2, temperature=temperature, **OFF)
    for logits, o in zip(_forward_logits(model, tok, prompts * 2, outs), outs, strict=True):
        assert len(o.logprobs) == len(o.token_ids) > 0
        targets = torch.tensor(o.token_ids).unsqueeze(0)
        want = token_logprobs(logits.unsqueeze(0), targets, temperature)[0]  # the training's
        assert (torch.tensor(o.logprobs) - want).abs().max() < TOLERANCE


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 10, 1.0), (1.0, 0, 0.3), (0.5, 12, 0.8)]
)
def test_logprobs_on_are_the_processed_distribution(
    tiny, monkeypatch, temperature: float, top_k: int, top_p: float
) -> None:
    model, tok = tiny
    _with_generation_config(monkeypatch, model, HOSTILE)
    prompts = _prompts(tok)
    kw = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    outs = _sample(HFGenerator(model, tok), prompts, 2, **kw)
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
    gen = HFGenerator(model, tok)
    prompts = _prompts(tok)
    greedy = gen.generate(prompts, max_new_tokens=8, temperature=None, **OFF)
    top1 = gen.generate(prompts, max_new_tokens=8, temperature=0.9, top_k=1, top_p=1.0)
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
    gen = HFGenerator(model, tok)
    prompts = _prompts(tok)
    outs = gen.generate(prompts, max_new_tokens=10, temperature=None, top_k=5, top_p=0.5)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _argmax_decode(model, p, tok.eos_token_id, 10)
        assert o.logprobs == []
    again = gen.generate(prompts, max_new_tokens=10, temperature=None, **OFF)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # top-k/p ignored


def test_a_model_config_we_cannot_neutralise_is_refused(tiny, monkeypatch) -> None:
    model, tok = tiny
    _with_generation_config(monkeypatch, model, {"suppress_tokens": [5]})
    with pytest.raises(ValueError, match="suppress_tokens"):
        HFGenerator(model, tok).generate([[70]], max_new_tokens=2, temperature=1.0, **OFF)


def test_responses_stop_at_eos(tiny) -> None:
    model, tok = tiny
    gen = HFGenerator(model, tok)
    torch.manual_seed(1)
    outs = gen.generate([[70]] * 16, max_new_tokens=40, temperature=1.0, **OFF)
    for o in outs:
        if o.finished:
            assert o.token_ids[-1] == tok.eos_token_id
            assert tok.eos_token_id not in o.token_ids[:-1]
        else:
            assert len(o.token_ids) == 40
        assert len(o.logprobs) == len(o.token_ids)
        assert all(lp <= 0.0 for lp in o.logprobs)
