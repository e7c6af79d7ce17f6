"""Rollout engines: the :class:`Generator` protocol and its backends.

The names resolve on first use, so the contract (:mod:`atgrpo.generation.base`) imports without
torch: the config builds each agent's :class:`SamplingParams` as it loads.
:class:`VLLMGenerator` needs the optional ``vllm`` extra only when an engine is started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from atgrpo.lazy import lazy_names

_HOMES = {
    "Generation": "atgrpo.generation.base",
    "Generator": "atgrpo.generation.base",
    "SamplingParams": "atgrpo.generation.base",
    "HFGenerator": "atgrpo.generation.hf",
    "decode_path": "atgrpo.generation.hf",
    "VLLMEngine": "atgrpo.generation.vllm",
    "VLLMGenerator": "atgrpo.generation.vllm",
    "VLLMSettings": "atgrpo.generation.vllm",
}

if TYPE_CHECKING:
    from atgrpo.generation.base import Generation, Generator, SamplingParams
    from atgrpo.generation.hf import HFGenerator, decode_path
    from atgrpo.generation.vllm import VLLMEngine, VLLMGenerator, VLLMSettings

__all__ = [
    "Generation",
    "Generator",
    "HFGenerator",
    "SamplingParams",
    "VLLMEngine",
    "VLLMGenerator",
    "VLLMSettings",
    "decode_path",
]


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
