"""Generation with Hugging Face transformers' ``generate``.

**Sampling.** One logits processor of ours, :class:`_Sampler`, does the whole sampling step: it
tempers the logits, keeps the top-k, then the top-p of what is left, renormalises
(:func:`process_logits`), draws the token by inverse CDF (:func:`sample_inverse_cdf`), records its
log-prob and returns scores that make the choice certain: a one-hot row, 1 for the drawn token
(uint8: a quarter of float32's bytes to write and for ``generate`` to scan, 1.0 against 1.7 ms
for its argmax over (32, 49152)). ``generate`` runs greedy (``do_sample=False``): its argmax
takes our token, and the warpers of transformers (temperature, top-k, top-p, min-p, typical-p,
...), which it builds only when sampling, never run. The recorded log-prob is thus that of the
distribution the token was drawn from. Only one (N, V) tensor of a step is alive, not
``output_scores``' (steps, N, V).

**Shared prefill** (``share_prefill=True``). The rollout asks for K samples of each prompt, so a
batch repeats every prompt K times. Each distinct prompt is prefilled once: one forward of the
distinct prompts but their last token, left-padded to the batch's width, with the position ids
``generate`` derives from the attention mask, fills a ``DynamicCache``. Decoding then holds each
prompt's keys and values once for its rows (:mod:`atgrpo.generation.prefix_cache`, on CPU with
float32 attention), or else copies its rows to the batch's order, in layers that append decoded
tokens in place (:mod:`atgrpo.generation.cache`). ``generate`` gets the whole (N, P) batch and
that cache; its prefill (``GenerationMixin._prefill``) sees P - 1 cached tokens and runs only
the last one. Every row sees the same padding, positions and mask as without sharing, so the
distribution is the same, up to the float rounding of differently shaped matmuls. The sampler
draws once per step for the whole batch in both paths, so a seed gives the same tokens in fp32
(the logits agree to 1e-6); under bf16 autocast that rounding (1e-4 in the log-probs) flips some
draws, not the distribution. A model whose cache cannot be copied row by row (recurrent state, a
static cache) is refused with an error naming ``rollout.share_prefill=false``. Distinct prompts
that share a long prefix (a tool's K branches asked of the next agent) prefill it once too, in
two passes over a layout whose masks and positions give each token the same computation
(:mod:`atgrpo.generation.prefixes`).

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
import inspect
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicLayer

from atgrpo.attention import ATTENTION, float32_attention
from atgrpo.generation import cpu_kernels, fused, memory
from atgrpo.generation.base import Generation, SamplingParams
from atgrpo.generation.cache import growing
from atgrpo.generation.packed import PackedLinears
from atgrpo.generation.packed import supported as packed_supported
from atgrpo.generation.prefix_cache import shared_prefix
from atgrpo.generation.prefixes import (
    Group,
    positions,
    prefix_groups,
    two_blocks,
    worth_sharing,
)
from atgrpo.models import autocast_for

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
    6e-8 of the total to 0 or 6e-8). It needs N uniforms, not the N x V of Gumbel-max.

    Measured with a timing script on 2 shared CPU cores, one torch thread, torch
    2.13, (N, V) = (32, 49152) float32 probabilities, a whole sampler step (tempering and
    log-softmax: 2.3 / 3.5 ms of it), best / median of 60 interleaved rounds:
    ``torch.multinomial`` 27.9 / 31.5 ms; this 2.6 / 3.7 ms; one float64 CDF over the
    vocabulary 5.2 / 12.7 ms (its (N, V) float64 buffers); a float32 one 3.5 / 5.3 ms (and
    inexact at the tail); Gumbel-max 30.6 / 39.3 ms (N x V exponentials).
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


class _Sampler(LogitsProcessor):
    """The whole sampling step (module docstring); the only processor ``generate`` runs."""

    def __init__(
        self,
        temperature: float,
        top_k: int,
        top_p: float,
        kernel: cpu_kernels.Kernel | None = None,
    ) -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.logprobs: list[torch.Tensor] = []  # each (N,): the drawn tokens' log-probs
        self.kernel = kernel  # float32 on CPU: the log-softmax and its exp in one kernel

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logprobs, probs = self._distribution(scores)  # (N, V) each
        token = sample_inverse_cdf(probs)  # (N, 1)
        self.logprobs.append(logprobs.gather(-1, token).squeeze(-1))
        # Greedy decoding's argmax must pick the drawn token: nothing else is possible.
        return torch.zeros_like(scores, dtype=torch.uint8).scatter_(-1, token, 1)

    def _distribution(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The processed log-probs and their exponentials, the probabilities drawn from."""
        whole = not 0 < self.top_k < scores.shape[-1] and self.top_p >= 1.0
        if self.kernel is not None and whole and scores.dtype == torch.float32:
            # x / 1.0 is x: the tempering is skipped only where it changes nothing
            logits = scores if self.temperature == 1.0 else scores / self.temperature
            return self.kernel.log_softmax_exp(logits)
        logprobs = process_logits(scores, self.temperature, self.top_k, self.top_p)
        return logprobs, logprobs.exp()

    def finish(self, batch: int) -> torch.Tensor:
        if not self.logprobs:
            return torch.zeros(batch, 0)
        return torch.stack(self.logprobs, dim=1)  # (N, steps)


class HFGenerator:
    """Batched sampling from a transformers causal LM (the default backend on CPU).

    ``share_prefill``: prefill each distinct prompt of a batch once (module docstring); False
    prefills every row. ``prompt_once``: then also hold each prompt's keys and values once while
    decoding, where :func:`reads_prompt_once` allows (:mod:`atgrpo.generation.prefix_cache`);
    False copies them to every row (the same attention; for measuring the two).
    ``pack_weights``: run the linear layers on weights packed once for oneDNN (bf16 autocast) or
    MKL (float32), on CPU (:mod:`atgrpo.generation.packed`; the same logits); False: the layers'
    own calls. ``decode_kernel``: in float32 on a CPU with AVX-512, atgrpo's CPU kernels for a
    decode step's linear layers (with ``pack_weights``, an attention's query, key and value
    layers as one call with the rotary embedding, an MLP's gate and up as one with SiLU:
    :mod:`atgrpo.generation.fused`), attention over prompts held once, norms and the sampler's
    log-softmax (:mod:`atgrpo.generation.cpu_kernels`; equal to torch's to rounding); False keeps
    MKL's packed sgemm and torch's operators (bit for bit the unpacked layers').
    ``held_bytes``: device memory held besides ``model``'s own state (the training model, when
    ``model`` is a copy of it to sample from), which ``max_batch_size: auto`` leaves free.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        share_prefill: bool,
        autocast_dtype: torch.dtype | None = None,
        max_batch_size: int | Literal["auto"] | None = None,
        prompt_once: bool = True,
        pack_weights: bool = True,
        decode_kernel: bool = True,
        held_bytes: int = 0,
    ) -> None:
        self.model = model
        self.held_bytes = held_bytes
        self.prompt_once = prompt_once
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.decode_kernel = decode_kernel and autocast_dtype is None and on_cpu
        self.packed = (
            PackedLinears(autocast_dtype, decode_kernel)
            if pack_weights and packed_supported(model, autocast_dtype)
            else None
        )
        if self.packed is not None:
            self.packed.drop_at_training_forward(model)
        self.tokenizer = tokenizer
        self.share_prefill = share_prefill
        self.autocast_dtype = autocast_dtype
        self.max_batch_size = max_batch_size
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        )
        if share_prefill:
            check_shareable(model)

    def _kernel(self) -> cpu_kernels.Kernel | None:
        """atgrpo's CPU kernels, where ``decode_kernel`` asks for them and they run here."""
        return cpu_kernels.extension() if self.decode_kernel else None

    def sync_weights(self) -> None:
        """``model`` holds the new weights (the training model itself, or a copy already
        refreshed); only the packed copies of its weights (``pack_weights``) are dropped, to be
        packed again from the new ones."""
        if self.packed is not None:
            self.packed.clear()

    def sleep(self) -> None:
        """Nothing to give back: the model it samples from stays in memory."""

    def wake_up(self) -> None:
        """Nothing was given back."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        sampler_args = None
        if params.temperature is not None:
            check_sampling(params.temperature, params.top_k, params.top_p)
            sampler_args = (params.temperature, params.top_k, params.top_p)
        out: list[Generation] = []
        step = self._rows_per_call(prompts, params.max_new_tokens)
        for start in range(0, len(prompts), step):
            chunk = prompts[start : start + step]
            out.extend(self._generate_batch(chunk, params.max_new_tokens, sampler_args))
        return out

    def _rows_per_call(self, prompts: list[list[int]], max_new_tokens: int) -> int:
        """``max_batch_size`` prompts a call; None: all; auto: as many as the cache budget
        takes (:mod:`atgrpo.generation.memory`)."""
        if isinstance(self.max_batch_size, int) and self.max_batch_size > 0:
            return self.max_batch_size
        if self.max_batch_size == memory.AUTO:
            width = max((len(p) for p in prompts), default=0)
            return memory.rows_per_call(
                self.model, len(prompts), width, max_new_tokens, self.held_bytes
            )
        return max(1, len(prompts))

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
        sampler = _Sampler(*sampler_args, self._kernel()) if sampler_args is not None else None
        sequences, width = self._run(
            prompts,
            input_ids.to(device),
            attention_mask.to(device),
            gen_config,
            LogitsProcessorList([sampler] if sampler is not None else []),
        )
        sequences = sequences.cpu()
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
        prompts: list[list[int]],
        input_ids: torch.Tensor,  # (N, P)
        attention_mask: torch.Tensor,  # (N, P)
        gen_config: GenerationConfig,
        processors: LogitsProcessorList,
    ) -> tuple[torch.Tensor, int]:  # (N, W + steps), the prompts' width W
        """Generate; with the shared prefill, ``generate`` continues from its cache, over the
        layout the prefill chose (the batch's, or two blocks: :mod:`atgrpo.generation.prefixes`)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with autocast_for(self.model, self.autocast_dtype), self._fast_layers():
                extra: dict[str, Any] = {}
                if self.share_prefill and input_ids.shape[1] > 1:  # width 1: nothing to share
                    name = cache_kwarg(unwrapped(self.model).forward)
                    extra[name], input_ids, attention_mask = self._prefill(
                        prompts, input_ids, attention_mask
                    )
                    gen_config.use_cache = True  # None would take the model's, maybe False
                out = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    generation_config=gen_config,
                    logits_processor=processors,
                    **extra,
                )
                return out, input_ids.shape[1]
        finally:
            self.model.train(was_training)

    @contextlib.contextmanager
    def _fast_layers(self) -> Iterator[None]:
        """The linear layers on packed weights (``pack_weights``) and, where the CPU kernels run
        (``decode_kernel``), norms, MLPs and attentions on them, their layers of one input
        packed together (:mod:`atgrpo.generation.fused`)."""
        packed, kernel = self.packed, self._kernel()
        with contextlib.ExitStack() as stack:
            together = None
            if packed is not None:
                groups = fused.groups(self.model) if kernel else []
                together = stack.enter_context(packed.active(self.model, groups))
            if kernel:
                stack.enter_context(fused.active(self.model, kernel, together))
            yield

    def _prefill(
        self,
        prompts: list[list[int]],
        input_ids: torch.Tensor,  # (N, P)
        attention_mask: torch.Tensor,  # (N, P)
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:  # N rows of W - 1 tokens, (N, W) x 2
        """The cache of every row's prompt but its last token, each distinct prompt run once
        (and a prefix that distinct prompts share, once), with the ids and mask ``generate``
        continues from: the batch's own, or the two-block layout.

        The distinct rows keep the batch's padding, and get the position ids ``generate``
        derives from the mask (``_prepare_position_ids_for_generation``): without them a
        left-padded row would be run at shifted positions.
        """
        firsts, rows = distinct_rows(prompts)
        forward = unwrapped(self.model).forward
        heads = [prompts[i][:-1] for i in firsts]
        groups = prefix_groups(heads)
        if _accepts(forward, "position_ids") and worth_sharing(groups, heads):
            cache, ids, mask = self._prefill_prefixes(heads, groups, input_ids.device)
            last = input_ids[firsts, -1:]  # (D, 1): generate's own prefill runs these
            input_ids = torch.cat([ids, last], dim=1)[rows]
            attention_mask = torch.cat([mask, torch.ones_like(last)], dim=1)[rows]
        else:
            ids, mask = input_ids[firsts, :-1], attention_mask[firsts, :-1]  # (D, P - 1)
            cache = self._forward_into(_empty_cache(self.model), ids, mask)
        once = self.prompt_once and len(firsts) < len(rows)
        index = torch.tensor(rows, device=ids.device)
        if once and reads_prompt_once(self.model, self.autocast_dtype, cache):
            return shared_prefix(cache, index, self._kernel()), input_ids, attention_mask
        cache.batch_select_indices(index)  # (N, ...) rows
        # decoding appends in place (atgrpo.generation.cache)
        return growing(cache), input_ids, attention_mask

    def _prefill_prefixes(
        self, heads: list[list[int]], groups: list[Group], device: torch.device
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:  # D rows of L + S tokens, (D, L + S)
        """Each group's prefix in one pass, then every prompt's rest over a copy of its group's
        keys and values (:mod:`atgrpo.generation.prefixes`)."""
        blocks = two_blocks(heads, groups, self.pad_id)
        prefix_ids, group_of = blocks.prefix_ids.to(device), blocks.group_of.to(device)
        cache = self._forward_into(
            _empty_cache(self.model), prefix_ids, blocks.prefix_mask.to(device)
        )
        cache.batch_select_indices(group_of)  # (D, ...): each prompt's group's prefix
        rest, mask = blocks.rest_ids.to(device), blocks.mask.to(device)
        if rest.shape[1]:
            cache = self._forward_into(cache, rest, mask)
        return cache, torch.cat([prefix_ids[group_of], rest], dim=1), mask

    def _forward_into(
        self,
        cache: DynamicCache,
        ids: torch.Tensor,  # (D, T): the tokens to add to the cache
        mask: torch.Tensor,  # (D, cached + T): the cached tokens' and these
    ) -> DynamicCache:
        """Run ``ids`` through the model into ``cache``, at the positions the mask gives."""
        forward = unwrapped(self.model).forward
        kwargs: dict[str, Any] = {cache_kwarg(forward): cache}
        if _accepts(forward, "position_ids"):  # generate passes them only then, too
            kwargs["position_ids"] = positions(mask)[:, -ids.shape[1] :]
        if _accepts(forward, "logits_to_keep"):  # the logits are not needed: compute one
            kwargs["logits_to_keep"] = 1
        self.model(input_ids=ids, attention_mask=mask, use_cache=True, **kwargs)
        return cache


def reads_prompt_once(model: Any, autocast_dtype: torch.dtype | None, cache: DynamicCache) -> bool:
    """Whether decoding can hold each prompt once (:mod:`atgrpo.generation.prefix_cache`): on
    CPU, with atgrpo's attention computing in float32, over plain ``DynamicLayer``s."""
    base = unwrapped(model)
    if base.config._attn_implementation != ATTENTION or base.device.type != "cpu":
        return False
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return False
    if autocast_dtype is None and base.dtype == torch.float32:
        return True  # float32 throughout
    return float32_attention()  # this CPU's half-precision attention is slower: float32 here


def distinct_rows(prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """The first row of each distinct prompt, and each row's index among the distinct ones."""
    slot: dict[tuple[int, ...], int] = {}
    firsts: list[int] = []
    rows: list[int] = []
    for i, p in enumerate(prompts):
        key = tuple(p)
        if key not in slot:
            slot[key] = len(firsts)
            firsts.append(i)
        rows.append(slot[key])
    return firsts, rows


# Cache layers whose rows are independent tensors of keys and values, so that copying rows
# gives what prefilling each copy would have (recurrent states, static buffers are not).
_SHAREABLE_LAYERS = {"DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer"}
_SHARE_OFF = "set rollout.share_prefill=false to prefill every sample"


def check_shareable(model: Any) -> None:
    """Raise a ValueError if the model's prefilled cache cannot be shared between rows."""
    base = unwrapped(model)
    why = None
    if base.config.is_encoder_decoder:
        why = "it is an encoder-decoder"
    elif (kind := getattr(base.generation_config, "cache_implementation", None)) is not None:
        why = f"its generation config asks for a {kind!r} cache"  # generate refuses a cache then
    elif not base._supports_default_dynamic_cache():
        why = "it does not use a DynamicCache"
    else:
        odd = {type(x).__name__ for x in _empty_cache(base).layers} - _SHAREABLE_LAYERS
        if odd:
            why = f"its cache has layers {sorted(odd)}"
    if why is not None:
        raise ValueError(f"cannot share the prefill of {type(base).__name__}: {why}; {_SHARE_OFF}")


def _empty_cache(model: Any) -> DynamicCache:
    # The cache generate itself would build (_prepare_cache_for_generation).
    return DynamicCache(config=model.config.get_text_config(decoder=True))


def unwrapped(model: Any) -> Any:
    # A peft model's generate runs its base model's (whose forward holds the adapters).
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _accepts(forward: Any, name: str) -> bool:
    return name in inspect.signature(forward).parameters


def cache_kwarg(forward: Any) -> str:
    # transformers 5.24 names it ``cache`` (``past_key_values`` deprecated); 5.19 does not.
    return "cache" if _accepts(forward, "cache") else "past_key_values"


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
