"""Rollout engines: the :class:`Generator` protocol and its backends.

:class:`VLLMGenerator` needs the optional ``vllm`` extra only when an engine is started.
"""

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
