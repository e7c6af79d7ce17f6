"""Package faces whose public names resolve on first use (PEP 562 ``__getattr__``).

``import atgrpo`` and ``import atgrpo.generation`` then load no torch: a name is imported from its
home module the first time it is read, and kept as a plain attribute after that.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose names live in the modules of ``homes``
    (name -> module)."""

    def getattr_(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)  # the next lookup is a plain attribute
        return value

    def dir_() -> list[str]:
        return sorted([*vars(sys.modules[package]), *homes])

    return getattr_, dir_
