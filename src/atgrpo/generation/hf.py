"""Generation with Hugging Face transformers' ``generate``.

``generate`` decodes greedily over the scores of our sampler, which draws each token and records
its log-prob (:mod:`atgrpo.generation.sampler`, with the generation config that keeps the
model's own settings out). On CPU the decode step runs on the CPU decode engine
(:mod:`atgrpo.generation.cpu`), entered here at one place, :class:`HFGenerator`'s ``cpu``;
``cpu_kernels=False`` (``rollout.cpu_kernels: off``) leaves plain transformers and the sampler.

**Shared prefill** (``share_prefill=True``). The rollout asks for K samples of each prompt, so a
batch repeats every prompt K times. Each distinct prompt is prefilled once: one forward of the
distinct prompts but their last token, left-padded to the batch's width, with the position ids
``generate`` derives from the attention mask, fills a ``DynamicCache``. Decoding then holds each
prompt's keys and values once for its rows (:mod:`atgrpo.generation.cpu.prefix_cache`, on CPU
with float32 attention), or else copies its rows to the batch's order, in layers that append decoded
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
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Literal

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList

from atgrpo.generation import memory
from atgrpo.generation.base import Generation, SamplingParams
from atgrpo.generation.cache import growing
from atgrpo.generation.prefixes import (
    SharedPrefix,
    positions,
    prefix_groups,
    two_blocks,
    worth_sharing,
)
from atgrpo.generation.sampler import Sampler, check_sampling, neutral_generation_config
from atgrpo.models import accepts, autocast_for, cache_kwarg, eos_token_ids, unwrapped

if TYPE_CHECKING:
    from atgrpo.generation.cpu import CpuEngine


class HFGenerator:
    """Batched sampling from a transformers causal LM (the default backend on CPU).

    ``share_prefill``: prefill each distinct prompt of a batch once (module docstring); False
    prefills every row. ``cpu_kernels``: on CPU, decode on the CPU decode engine
    (:class:`atgrpo.generation.cpu.CpuEngine`: packed weights, atgrpo's kernels where they run,
    prompts held once while decoding; the same tokens, or equal to rounding with the kernels);
    False: plain transformers and the sampler. ``prompt_once``, ``pack_weights`` and
    ``decode_kernel`` turn its parts off one by one, for measuring them (the engine's docstring).
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
        cpu_kernels: bool = True,
        prompt_once: bool = True,
        pack_weights: bool = True,
        decode_kernel: bool = True,
        held_bytes: int = 0,
    ) -> None:
        self.model = model
        self.held_bytes = held_bytes
        self.cpu: CpuEngine | None = None
        if cpu_kernels and next(model.parameters()).device.type == "cpu":
            self.cpu = _cpu_engine()(
                model,
                autocast_dtype,
                prompt_once=prompt_once,
                pack_weights=pack_weights,
                decode_kernel=decode_kernel,
            )
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

    def sync_weights(self) -> None:
        """``model`` holds the new weights (the training model itself, or a copy already
        refreshed); only the CPU engine's packed copies of its weights are dropped, to be packed
        again from the new ones."""
        if self.cpu is not None:
            self.cpu.refresh()

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
        sampler = None
        if sampler_args is not None:
            fast = self.cpu.log_softmax_exp() if self.cpu is not None else None
            sampler = Sampler(*sampler_args, fast)
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
            layers = self.cpu.layers() if self.cpu is not None else contextlib.nullcontext()
            with autocast_for(self.model, self.autocast_dtype), layers:
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
        if accepts(forward, "position_ids") and worth_sharing(groups, heads):
            cache, ids, mask = self._prefill_prefixes(heads, groups, input_ids.device)
            last = input_ids[firsts, -1:]  # (D, 1): generate's own prefill runs these
            input_ids = torch.cat([ids, last], dim=1)[rows]
            attention_mask = torch.cat([mask, torch.ones_like(last)], dim=1)[rows]
        else:
            ids, mask = input_ids[firsts, :-1], attention_mask[firsts, :-1]  # (D, P - 1)
            cache = self._forward_into(_empty_cache(self.model), ids, mask)
        index = torch.tensor(rows, device=ids.device)
        repeats = len(firsts) < len(rows)
        held = self.cpu.hold_prompts_once(cache, index) if repeats and self.cpu else None
        if held is not None:  # each prompt's keys and values held once (the CPU engine)
            return held, input_ids, attention_mask
        cache.batch_select_indices(index)  # (N, ...) rows
        # decoding appends in place (atgrpo.generation.cache)
        return growing(cache), input_ids, attention_mask

    def _prefill_prefixes(
        self, heads: list[list[int]], groups: list[SharedPrefix], device: torch.device
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
        if accepts(forward, "position_ids"):  # generate passes them only then, too
            kwargs["position_ids"] = positions(mask)[:, -ids.shape[1] :]
        if accepts(forward, "logits_to_keep"):  # the logits are not needed: compute one
            kwargs["logits_to_keep"] = 1
        self.model(input_ids=ids, attention_mask=mask, use_cache=True, **kwargs)
        return cache


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


def decode_path(device: torch.device, autocast_dtype: torch.dtype | None, cpu_kernels: bool) -> str:
    """The path an HF engine's decode step takes on ``device``, in a few words (the run's header
    line): transformers on a GPU; on CPU the CPU decode engine's (:mod:`atgrpo.generation.cpu`),
    or torch where ``cpu_kernels`` is off."""
    if device.type != "cpu":
        return f"transformers on {device.type}"
    if not cpu_kernels:
        return "torch (rollout.cpu_kernels: off)"
    return _cpu_engine().decode_path(autocast_dtype)


def _cpu_engine() -> type[CpuEngine]:
    """The CPU decode engine: the one place the HF engine enters :mod:`atgrpo.generation.cpu`,
    imported here at first use, so that nothing loads it (its kernels, its patches of
    transformers' modules) until a model decodes on CPU."""
    from atgrpo.generation.cpu import CpuEngine

    return CpuEngine
