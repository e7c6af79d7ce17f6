"""Rollout engines: the :class:`Generator` protocol and its backends."""

from atgrpo.generation.base import Generation, Generator
from atgrpo.generation.hf import HFGenerator

__all__ = ["Generation", "Generator", "HFGenerator"]
