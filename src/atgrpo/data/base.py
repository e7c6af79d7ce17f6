"""What every dataset loader shares."""

from __future__ import annotations


class DatasetError(RuntimeError):
    """A dataset cannot be read; the message is one line that says how to get it."""
