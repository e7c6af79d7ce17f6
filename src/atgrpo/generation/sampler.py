"""How the HF engine draws a token, and the generation config that lets only our sampler act.

**Sampling.** One logits processor of ours, :class:`Sampler`, does the whole sampling step: it
tempers the logits, keeps the top-k, then the top-p of what is left, renormalises
(:func:`process_logits`), draws the token by inverse CDF (:func:`sample_inverse_cdf`), records its
log-prob and returns scores that make the choice certain: a one-hot row, 1 for the drawn token
(uint8: a quarter of float32's bytes to write and for ``generate`` to scan; its argmax timed
in docs/results/cpu-decode.md). ``generate`` runs greedy (``do_sample=False``): its argmax
takes our token, and the warpers of transformers (temperature, top-k, top-p, min-p, typical-p,
...), which it builds only when sampling, never run. The recorded log-prob is thus that of the
distribution the token was drawn from. Only one (N, V) tensor of a step is alive, not
``output_scores``' (steps, N, V).

**Nothing from the model's generation config.** In transformers 5
(``GenerationMixin._prepare_generation_config`` in transformers/generation/utils.py) the
config we pass is copied, then every field of it that is ``None`` is filled from
``model.generation_config`` (``GenerationConfig.update(..., defaults_only=True)`` in
configuration_utils.py), then from ``GenerationConfig._get_default_generation_params`` (top-k
50 among them). ``None`` means "unset", not "off": a Qwen3-style ``generation_config.json``
(top_k 20, top_p 0.95) would cut what is sampled. In ``_get_logits_processor`` the processors
built from the config (repetition penalty, n-gram ban, min length, ...) come before ours
(``_merge_criteria_processor_list`` appends custom ones), and the warpers after it. So
:func:`neutral_generation_config` sets every field that changes the next-token distribution
under greedy decoding (or the decoding mode, or the outputs) to a non-``None`` neutral value,
which the merge keeps; the warpers are never built under greedy decoding.
Some fields are "off" only as ``None`` (``suppress_tokens``, ``bad_words_ids``,
``forced_eos_token_id``, ``sequence_bias``, ...; :data:`_OFF_ONLY_AS_NONE`); a model whose
generation config sets one of them is refused with an error instead of being sampled from a
distribution we do not record.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor

# float32 (N, V) logits -> their log-softmax and its exp (atgrpo's CPU kernel does both at once)
LogSoftmaxExp = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# Every GenerationConfig field that changes which token comes next, the decoding mode or what
# ``generate`` returns, at a non-None neutral value (None would be filled from the model).
_NEUTRAL: dict[str, Any] = {
    # Decoding mode: greedy, one beam, one sequence; no contrastive / assisted / DoLa search.
    "do_sample": False,
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "penalty_alpha": 0.0,
    "diversity_penalty": 0.0,
    "length_penalty": 1.0,
    "early_stopping": False,
    "use_mtp": False,
    # The warpers (temperature, top-k, top-p, min-p, typical-p, top-h, epsilon / eta cutoffs)
    # are built only when do_sample is True (GenerationMixin._get_logits_processor), so they
    # never run here, whatever the model's config says; we leave them unset, which is also
    # what keeps GenerationConfig.validate from warning that they "may be ignored".
    # Processors that run under greedy decoding too.
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "guidance_scale": 1.0,
    "min_new_tokens": 0,  # takes precedence over any min_length (_prepare_generated_length)
    "remove_invalid_values": False,
    "renormalize_logits": False,
    "token_healing": False,
    # Outputs: sequences only (a model's return_dict_in_generate would change the return type).
    "output_scores": False,
    "output_logits": False,
    "output_attentions": False,
    "output_hidden_states": False,
    "return_dict_in_generate": False,
}
# Fields whose only "off" is None, so a model's value would survive the merge: refused.
_OFF_ONLY_AS_NONE = (
    "sequence_bias",
    "bad_words_ids",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "watermarking_config",
    "constraints",
    "force_words_ids",
    "dola_layers",
    "prompt_lookup_num_tokens",
    "assistant_early_exit",
    "stop_strings",
    "max_time",
)


def neutral_generation_config(
    model_config: GenerationConfig, *, max_new_tokens: int, eos_ids: list[int], pad_id: int
) -> GenerationConfig:
    """A greedy config with every processing field neutral, whatever ``model_config`` holds."""
    refused = [f for f in _OFF_ONLY_AS_NONE if getattr(model_config, f, None) is not None]
    if refused:
        raise ValueError(
            f"the model's generation config sets {refused}, which transformers would apply "
            "under our sampler (they are off only as None); unset them in "
            "model.generation_config"
        )
    return GenerationConfig(
        **_NEUTRAL, max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad_id
    )


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise a ValueError for settings that define no distribution."""
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be > 0 (None: greedy), not {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), not {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1: off), not {top_p}")


def process_logits(
    scores: torch.Tensor,  # (N, V)
    temperature: float,
    top_k: int,
    top_p: float,
) -> torch.Tensor:  # (N, V) float32
    """Log-probs of the sampled distribution: tempered, top-k, then top-p, renormalised.

    Top-k keeps the ``top_k`` tokens ``torch.topk`` returns (0 or >= V: all). Top-p then keeps
    the smallest set of the most likely remaining tokens whose probability reaches ``top_p``
    (at least one; 1.0: all). Tokens outside the kept set get -inf.
    """
    logits = scores.float() / temperature  # (N, V)
    if 0 < top_k < logits.shape[-1]:
        kept = torch.topk(logits, top_k, dim=-1).indices  # (N, k)
        dropped = torch.ones_like(logits, dtype=torch.bool).scatter_(-1, kept, False)
        logits = logits.masked_fill(dropped, -math.inf)
    if top_p < 1.0:
        logits = _top_p(logits, top_p)
    return torch.log_softmax(logits, dim=-1)


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    ordered, order = logits.sort(dim=-1, descending=True)  # (N, V) each
    probs = ordered.softmax(dim=-1)  # (N, V) renormalised over what top-k kept
    above = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    # A token is needed while the tokens above it hold less than top_p; the first always is.
    dropped_sorted = above >= top_p  # (N, V)
    dropped = torch.empty_like(dropped_sorted).scatter_(-1, order, dropped_sorted)
    return logits.masked_fill(dropped, -math.inf)


_BLOCK = 256  # tokens per block of the two-level inverse CDF in sample_inverse_cdf


def sample_inverse_cdf(
    probs: torch.Tensor,  # (N, V) >= 0, each row with a positive sum
    u: torch.Tensor | None = None,  # (N, 1) float64 uniforms in [0, 1); None: torch.rand
) -> torch.Tensor:  # (N, 1) long
    """One token per row, drawn from ``probs / probs.sum(-1)`` by a two-level inverse CDF.

    ``x = u * total`` falls in block b when ``edges[b] <= x < edges[b+1]`` (the blocks' masses
    summed), then in token i of that block when ``cdf[i-1] <= y < cdf[i]``, ``y`` being x's
    place in the block rescaled to the block's float64 CDF: intervals of width ``p_i``, empty
    for a zero-probability token, so it is never drawn; x and y are kept below their totals,
    so the search never runs past the last possible token. A token's probability is exact up
    to the float32 rounding of its block's sum (relative 1e-7, like the probabilities' own);
    a tail token keeps its interval (a float32 CDF over the vocabulary rounds any token below
    6e-8 of the total to 0 or 6e-8). It needs N uniforms, not the N x V of Gumbel-max, and
    was the fastest of the draws timed against it (``torch.multinomial``, one float64 or
    float32 CDF over the vocabulary, Gumbel-max: docs/results/cpu-decode.md).
    """
    n, v = probs.shape
    if u is None:
        u = torch.rand(n, 1, dtype=torch.float64, device=probs.device)
    ends = _block_masses(probs).cumsum(-1)  # (N, blocks): where each block ends
    edges = torch.nn.functional.pad(ends, (1, 0))  # (N, blocks + 1): block b is [b, b+1)
    total = ends[:, -1:]  # (N, 1)
    x = torch.minimum(u * total, _below(total))  # (N, 1) in [0, total)
    block = torch.searchsorted(ends, x, right=True)  # (N, 1): the first b with ends[b] > x
    lo, hi = edges.gather(-1, block), edges.gather(-1, block + 1)  # (N, 1) each, lo < hi
    index = block * _BLOCK + torch.arange(_BLOCK, device=probs.device)  # (N, B) token ids
    inside = probs.gather(-1, index.clamp_max(v - 1)).double().masked_fill(index >= v, 0.0)
    cdf = inside.cumsum(-1)  # (N, B) float64: sequential on CPU, equal neighbours where p = 0
    last = cdf[:, -1:]  # (N, 1) > 0: the block holds mass
    y = torch.minimum((x - lo) / (hi - lo) * last, _below(last))  # (N, 1) in [0, last)
    token = index.gather(-1, torch.searchsorted(cdf, y, right=True))  # (N, 1)
    # A parallel scan (GPU) may round neighbours apart by an ulp where p = 0: never return an
    # impossible token, whatever the rounding (on CPU this never acts).
    possible = probs.gather(-1, token) > 0  # (N, 1)
    if bool(possible.all()):
        return token
    return torch.where(possible, token, probs.argmax(-1, keepdim=True))


def _block_masses(probs: torch.Tensor) -> torch.Tensor:  # (N, V) -> (N, ceil(V / B)) float64
    # Summed in float32: a float64 copy of (N, V) costs more than the whole draw.
    n, v = probs.shape
    whole = v // _BLOCK * _BLOCK
    masses = [probs[:, :whole].reshape(n, -1, _BLOCK).sum(-1)]  # (N, V // B)
    if whole < v:
        masses.append(probs[:, whole:].sum(-1, keepdim=True))  # (N, 1): the partial block
    return torch.cat(masses, dim=-1).double()


def _below(total: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(total, torch.zeros_like(total))  # the largest float64 < total


class Sampler(LogitsProcessor):
    """The whole sampling step (module docstring); the only processor ``generate`` runs.

    ``log_softmax_exp``: where given (atgrpo's CPU kernel), it computes the float32 log-probs
    and probabilities when nothing cuts the vocabulary; equal to torch's to rounding.
    """

    def __init__(
        self,
        temperature: float,
        top_k: int,
        top_p: float,
        log_softmax_exp: LogSoftmaxExp | None = None,
    ) -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.logprobs: list[torch.Tensor] = []  # each (N,): the drawn tokens' log-probs
        self.log_softmax_exp = log_softmax_exp

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logprobs, probs = self._distribution(scores)  # (N, V) each
        token = sample_inverse_cdf(probs)  # (N, 1)
        self.logprobs.append(logprobs.gather(-1, token).squeeze(-1))
        # Greedy decoding's argmax must pick the drawn token: nothing else is possible.
        return torch.zeros_like(scores, dtype=torch.uint8).scatter_(-1, token, 1)

    def _distribution(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The processed log-probs and their exponentials, the probabilities drawn from."""
        whole = not 0 < self.top_k < scores.shape[-1] and self.top_p >= 1.0
        if self.log_softmax_exp is not None and whole and scores.dtype == torch.float32:
            # x / 1.0 is x: the tempering is skipped only where it changes nothing
            logits = scores if self.temperature == 1.0 else scores / self.temperature
            return self.log_softmax_exp(logits)
        logprobs = process_logits(scores, self.temperature, self.top_k, self.top_p)
        return logprobs, logprobs.exp()

    def finish(self, batch: int) -> torch.Tensor:
        if not self.logprobs:
            return torch.zeros(batch, 0)
        return torch.stack(self.logprobs, dim=1)  # (N, steps)
