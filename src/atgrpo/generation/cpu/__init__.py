"""The CPU decode engine: what makes the HF engine's decode step fast on a CPU.

The HF engine (:mod:`atgrpo.generation.hf`) enters it at one place, a :class:`CpuEngine` per
model on CPU (:mod:`atgrpo.generation.cpu.engine`); nothing else in the package imports it.
Its modules:

* ``kernels.py`` and ``kernels.cpp``: atgrpo's float32 AVX-512 kernels for a decode step, built
  by the system's C++ compiler at first use, called through ctypes;
* ``packed.py``: linear layers on weights packed once per rollout (oneDNN, MKL or the kernels);
* ``fused.py``: norms, gated MLPs and attention inputs on the kernels;
* ``prefix_cache.py``: each prompt's keys and values held once while its K rows decode.

``rollout.cpu_kernels: off`` turns all of it off. The names below are its public API, for the
HF engine, the benchmarks and the tests.
"""

from atgrpo.generation.cpu.engine import CpuEngine
from atgrpo.generation.cpu.fused import active as fused_forwards
from atgrpo.generation.cpu.fused import groups as fused_groups
from atgrpo.generation.cpu.kernels import (
    MAX_ROWS,
    PANEL,
    Kernel,
    applies,
    build,
    cpu_supports,
    extension,
)
from atgrpo.generation.cpu.packed import PackedLinears
from atgrpo.generation.cpu.packed import supported as packing_supported
from atgrpo.generation.cpu.prefix_cache import (
    SharedPrefixLayer,
    prefix_attention,
    reads_prompt_once,
    shared_prefix,
)

__all__ = [
    "MAX_ROWS",
    "PANEL",
    "CpuEngine",
    "Kernel",
    "PackedLinears",
    "SharedPrefixLayer",
    "applies",
    "build",
    "cpu_supports",
    "extension",
    "fused_forwards",
    "fused_groups",
    "packing_supported",
    "prefix_attention",
    "reads_prompt_once",
    "shared_prefix",
]
