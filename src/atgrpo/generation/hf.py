"""Generation with Hugging Face transformers' ``generate``.

The log-probs returned are those of the distribution that was sampled. We apply the temperature
ourselves in a logits processor that is the *only* processor (``generate`` is called with
temperature 1 and no top-k / top-p, so it adds no warper of its own) and that records the
tempered log-softmax of each step; the token chosen at step t is read from ``input_ids`` at
step t+1. This keeps one (N, V) tensor alive instead of ``output_scores``' (steps, N, V).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from atgrpo.generation.base import Generation


class _TemperatureRecorder(LogitsProcessor):
    def __init__(self, temperature: float, prompt_len: int) -> None:
        self.temperature = temperature
        self.prompt_len = prompt_len
        self.pending: torch.Tensor | None = None  # (N, V) log-probs of the last step
        self.logprobs: list[torch.Tensor] = []  # each (N,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._collect(input_ids)
        scores = scores.float() / self.temperature  # (N, V)
        self.pending = torch.log_softmax(scores, dim=-1)
        return scores

    def _collect(self, input_ids: torch.Tensor) -> None:
        if self.pending is not None:
            chosen = input_ids[:, -1:]  # (N, 1) the token sampled from `pending`
            self.logprobs.append(self.pending.gather(-1, chosen).squeeze(-1))
            self.pending = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        self._collect(sequences)
        if not self.logprobs:
            return torch.zeros(sequences.shape[0], 0)
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
    ) -> list[Generation]:
        out: list[Generation] = []
        step = self.max_batch_size or max(1, len(prompts))
        for start in range(0, len(prompts), step):
            chunk = prompts[start : start + step]
            out.extend(self._generate_batch(chunk, max_new_tokens, temperature))
        return out

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float | None
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
        sample = temperature is not None
        gen_config = GenerationConfig(
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_k=None,
            top_p=None,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        recorder = _TemperatureRecorder(temperature, width) if temperature is not None else None
        processors = LogitsProcessorList([recorder] if recorder is not None else [])
        was_training = self.model.training
        self.model.eval()
        autocast = (
            torch.autocast(device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        try:
            with autocast:
                sequences = self.model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    generation_config=gen_config,
                    logits_processor=processors,
                )
        finally:
            self.model.train(was_training)
        sequences = sequences.cpu()
        logprobs = recorder.finish(sequences).cpu() if recorder is not None else None
        results = []
        for i in range(len(prompts)):
            new = sequences[i, width:].tolist()
            cut = next((j + 1 for j, t in enumerate(new) if t in self.eos_ids), None)
            tokens = new[:cut] if cut is not None else new
            lps = logprobs[i, : len(tokens)].tolist() if logprobs is not None else []
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            results.append(Generation(tokens, lps, text, finished=cut is not None))
        return results


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
