"""Generation with Hugging Face transformers' ``generate``.

**Sampling.** One logits processor of ours, :class:`_Sampler`, does the whole sampling step:
it tempers the logits, keeps the top-k, then the top-p of what is left, renormalises
(:func:`process_logits`), draws the token with ``torch.multinomial``, records its log-prob and
returns scores that make the choice certain (0 for the drawn token, -inf elsewhere).
``generate`` runs greedy (``do_sample=False``): its argmax takes our token, and the warpers of
transformers (temperature, top-k, top-p, min-p, typical-p, ...), which it builds only when
sampling, never run. The recorded log-prob is thus that of the distribution the token was
drawn from. Only one (N, V) tensor of a step is alive, not ``output_scores``' (steps, N, V).

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

import contextlib
import math
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from atgrpo.generation.base import Generation

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


class _Sampler(LogitsProcessor):
    """The whole sampling step (module docstring); the only processor ``generate`` runs."""

    def __init__(self, temperature: float, top_k: int, top_p: float) -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.logprobs: list[torch.Tensor] = []  # each (N,): the drawn tokens' log-probs

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logprobs = process_logits(scores, self.temperature, self.top_k, self.top_p)  # (N, V)
        token = torch.multinomial(logprobs.exp(), num_samples=1)  # (N, 1)
        self.logprobs.append(logprobs.gather(-1, token).squeeze(-1))
        # Greedy decoding's argmax must pick the drawn token: nothing else is possible.
        return torch.full_like(scores, -math.inf).scatter_(-1, token, 0.0)

    def finish(self, batch: int) -> torch.Tensor:
        if not self.logprobs:
            return torch.zeros(batch, 0)
        return torch.stack(self.logprobs, dim=1)  # (N, steps)


class HFGenerator:
    """Batched sampling from a transformers causal LM (the default backend on CPU)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        autocast_dtype: torch.dtype | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.autocast_dtype = autocast_dtype
        self.max_batch_size = max_batch_size
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        )

    def sync_weights(self) -> None:
        """Nothing to do: generation runs on the training model itself."""

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float | None,
        top_k: int,
        top_p: float,
    ) -> list[Generation]:
        sampler_args = None
        if temperature is not None:
            check_sampling(temperature, top_k, top_p)
            sampler_args = (temperature, top_k, top_p)
        out: list[Generation] = []
        step = self.max_batch_size or max(1, len(prompts))
        for start in range(0, len(prompts), step):
            chunk = prompts[start : start + step]
            out.extend(self._generate_batch(chunk, max_new_tokens, sampler_args))
        return out

    @torch.no_grad()
    def _generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampler_args: tuple[float, int, float] | None,
    ) -> list[Generation]:
        if not prompts:
            return []
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, as the training forward does
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p) :] = 1
        gen_config = neutral_generation_config(
            self.model.generation_config,
            max_new_tokens=max_new_tokens,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
        )
        sampler = _Sampler(*sampler_args) if sampler_args is not None else None
        sequences = self._run(
            input_ids.to(device),
            attention_mask.to(device),
            gen_config,
            LogitsProcessorList([sampler] if sampler is not None else []),
        ).cpu()
        logprobs = sampler.finish(len(prompts)).cpu() if sampler is not None else None
        results = []
        for i in range(len(prompts)):
            new = sequences[i, width:].tolist()
            cut = next((j + 1 for j, t in enumerate(new) if t in self.eos_ids), None)
            tokens = new[:cut] if cut is not None else new
            lps = logprobs[i, : len(tokens)].tolist() if logprobs is not None else []
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            results.append(Generation(tokens, lps, text, finished=cut is not None))
        return results

    def _run(
        self,
        input_ids: torch.Tensor,  # (N, P)
        attention_mask: torch.Tensor,  # (N, P)
        gen_config: GenerationConfig,
        processors: LogitsProcessorList,
    ) -> torch.Tensor:  # (N, P + steps)
        was_training = self.model.training
        self.model.eval()
        autocast = (
            torch.autocast(input_ids.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        try:
            with autocast:
                return self.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    generation_config=gen_config,
                    logits_processor=processors,
                )
        finally:
            self.model.train(was_training)


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a response: the generation config's, then the tokenizer's."""
    ids: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        for t in source if isinstance(source, list) else [source]:
            if t not in ids:
                ids.append(int(t))
    if not ids:
        raise ValueError("the tokenizer and generation config define no end-of-sequence token")
    return ids
