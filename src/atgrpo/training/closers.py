"""Closing what a run started: every part, even when closing another fails."""

from __future__ import annotations

from collections.abc import Callable


def close_all(closers: list[Callable[[], None]]) -> None:
    """Call every closer, last started first (env workers and groups before the Ray
    connection they run on; loggers in reverse), each one even when a later-started one fails;
    the first failure is raised. Empties ``closers``."""
    if closers:
        close = closers.pop()
        try:
            close()
        finally:
            close_all(closers)
