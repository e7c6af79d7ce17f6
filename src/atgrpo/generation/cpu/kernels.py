"""atgrpo's CPU kernels for a float32 decode step, compiled for AVX-512 at first use.

A decode step of a small model on a CPU is a few rows through many layers. Eager torch runs it as
hundreds of library calls and operators each step, each a few microseconds of arithmetic behind a
dispatch, and its linear layers on MKL's packed sgemm, which reads a weight and multiplies it one
after the other. ``kernels.cpp`` holds the kernels for that step, each computing what
torch's path computes, in float32, equal to it to rounding (not bit for bit; the rotary
embedding bit for bit):

* :meth:`Kernel.linear`: a linear layer at up to :data:`MAX_ROWS` rows on its weight packed once
  into panels of 32 output columns, prefetching the panel's next lines while it multiplies, so
  that reading the weight overlaps the arithmetic (:mod:`atgrpo.generation.cpu.packed` uses it;
  several layers of one input packed together run as one, :mod:`atgrpo.generation.cpu.fused`);
* :meth:`Kernel.linear_silu_mul`: a gated MLP's gate and up layers packed together and
  ``silu(gate) * up`` in one call;
* :meth:`Kernel.rope`: the rotary embedding of a query and key, in place;
* :meth:`Kernel.prefix_attention`: the attention over prompts held once
  (:mod:`atgrpo.generation.cpu.prefix_cache`) in one call, each prompt's keys and values read once
  for all its rows and query heads;
* :meth:`Kernel.rms_norm` and :meth:`Kernel.silu_mul`: a norm and a gated MLP's activation in
  one pass (:mod:`atgrpo.generation.cpu.fused`);
* :meth:`Kernel.log_softmax_exp`: the sampler's log-probs over the vocabulary and the
  probabilities drawn from, in two passes (:class:`atgrpo.generation.sampler.Sampler`, where no
  top-k or top-p cuts the vocabulary).

A sampled token's recorded log-prob is the one of the logits it was drawn from, as always; the
update recomputes log-probs with torch's own path, which differs from generation's by rounding
only. Their timings: docs/results/cpu-decode.md.

Built on CPUs where torch reports AVX-512, by the C++ compiler (``$CXX``, else ``c++``) into
atgrpo's cache, once per source and compiler; a model that is not float32 or a shape a
kernel does not take runs on torch as before. Where the kernels cannot be built,
:func:`extension` warns once with the reason and returns None, and generation runs without them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from atgrpo.models import cache_dir

_SOURCE = Path(__file__).with_name("kernels.cpp")
# -ffp-contract=off: a product and a sum the source writes apart are rounded apart, as torch rounds
# them (the compiler would otherwise fuse them into one multiply-add)
_FLAGS = [
    "-O3", "-mavx512f", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17"
]  # fmt: skip

# The most rows a call runs through the kernel: at 96 rows and more it is level with MKL
# (docs/results/cpu-decode.md), so larger calls (a prefill) keep torch's own linear.
MAX_ROWS = 64
# Output columns of a packed panel: a weight whose output size is not a multiple keeps MKL.
PANEL = 32


def applies(weight: torch.Tensor) -> bool:
    """Whether the kernel can run this weight: float32 on CPU, outputs a multiple of
    :data:`PANEL`."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.shape[0] % PANEL == 0
    )


def cpu_supports() -> bool:
    """Whether this CPU runs AVX-512 code, as torch's own kernel dispatch sees it."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


class _Attention(ctypes.Structure):
    """The C struct ``Attention`` of kernels.cpp, field for field."""

    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ["query", "prompt_kt", "prompt_v", "own_k"]],
        *[(name, ctypes.c_void_p) for name in ["own_v", "members", "mask"]],
        ("mask_kind", ctypes.c_int),
        *[(name, ctypes.c_int64) for name in ["mask_row", "own_row", "own_head", "heads"]],
        *[(name, ctypes.c_int64) for name in ["kv_heads", "prompt", "prompt16", "own"]],
        *[(name, ctypes.c_int64) for name in ["prompts", "width"]],
        ("scale", ctypes.c_float),
        ("out", ctypes.c_void_p),
    ]


class Kernel:
    """The compiled kernels: :meth:`pack` a weight once, :meth:`linear` on it per call;
    :meth:`prefix_attention` for a decode step over prompts held once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        c_ptr, c_int64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._run = library.atgrpo_decode_linear
        self._run_silu_mul = library.atgrpo_decode_linear_silu_mul
        for run in (self._run, self._run_silu_mul):
            run.argtypes = [c_ptr, c_ptr, c_ptr, c_int64, c_int64, c_int64, c_int]
            run.restype = None
        self._rope = library.atgrpo_rope
        self._rope.argtypes = [c_ptr, c_int64, c_int64, c_int64, c_int64, c_ptr, c_ptr, c_int64]
        self._rope.restype = None
        self._attend = library.atgrpo_prefix_attention
        self._attend.argtypes = [ctypes.POINTER(_Attention), c_int, c_int, c_int]
        self._attend.restype = c_int
        self._norm = library.atgrpo_rms_norm
        self._norm.argtypes = [c_ptr, c_ptr, c_ptr, c_int64, c_int64, ctypes.c_float]
        self._norm.restype = None
        self._silu_mul = library.atgrpo_silu_mul
        self._silu_mul.argtypes = [c_ptr, c_ptr, c_ptr, c_int64]
        self._silu_mul.restype = None
        self._log_softmax_exp = library.atgrpo_log_softmax_exp
        self._log_softmax_exp.argtypes = [c_ptr, c_ptr, c_ptr, c_int64, c_int64, c_int]
        self._log_softmax_exp.restype = None

    def log_softmax_exp(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``log_softmax(logits, -1)`` and its ``exp``, float32, in two passes over each row."""
        _check_float32(logits)
        if logits.dim() != 2:
            raise ValueError(f"log_softmax_exp takes (rows, vocabulary) logits; got {logits.shape}")
        logits = logits.contiguous()
        logprobs, probs = torch.empty_like(logits), torch.empty_like(logits)
        rows, vocab = logits.shape
        self._log_softmax_exp(
            logits.data_ptr(), logprobs.data_ptr(), probs.data_ptr(), rows, vocab,
            torch.get_num_threads(),
        )  # fmt: skip
        return logprobs, probs

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x ** 2, -1) + eps))`` in one pass, float32."""
        _check_float32(x, weight)
        if weight.shape != x.shape[-1:] or not weight.is_contiguous():
            raise ValueError(f"the norm's weight {tuple(weight.shape)} does not fit {x.shape}")
        x = x.contiguous()
        out = torch.empty_like(x)
        rows = x.numel() // x.shape[-1]
        self._norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, x.shape[-1], eps)
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` in one pass, float32."""
        _check_float32(gate, up)
        if gate.shape != up.shape:
            raise ValueError(
                f"silu_mul takes two tensors of one shape; got {gate.shape}, {up.shape}"
            )
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        self._silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
        return out

    @staticmethod
    def pack(*weights: torch.Tensor) -> torch.Tensor:
        """``weights`` (N_i, K) as panels (sum N_i / 32, K, 32) of 32 output columns: one weight,
        or several of one input stacked (their outputs side by side, as ``torch.cat`` of the
        weights would give them)."""
        for weight in weights:
            if not applies(weight) or weight.shape[1] != weights[0].shape[1]:
                raise ValueError(
                    f"the decode kernel packs 2-d float32 CPU weights of one input size whose "
                    f"rows are a multiple of {PANEL}; got {tuple(weight.shape)} {weight.dtype} on "
                    f"{weight.device}"
                )
        n_in = weights[0].shape[1]
        whole = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0]
        return whole.detach().reshape(-1, PANEL, n_in).transpose(1, 2).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """``x (M, K) @ weight.T`` from its packed panels: (M, N), float32."""
        return self._linear(self._run, x, packed, packed.shape[0] * PANEL)

    def linear_silu_mul(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """``silu(x @ gate.T) * (x @ up.T)`` from ``pack(gate, up)``: (M, N), N the gate's
        outputs, float32; equal to :meth:`linear` then :meth:`silu_mul`, bit for bit."""
        if packed.dim() != 3 or packed.shape[0] % 2:
            raise ValueError(
                f"linear_silu_mul takes a gate and an up weight packed together; got panels "
                f"{tuple(packed.shape)}"
            )
        return self._linear(self._run_silu_mul, x, packed, packed.shape[0] // 2 * PANEL)

    def _linear(self, run: Any, x: torch.Tensor, packed: torch.Tensor, n_out: int) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
            raise ValueError(
                f"the decode kernel takes 2-d float32 CPU rows; got {x.dtype} {x.shape}"
            )
        if packed.dim() != 3 or packed.shape[1] != x.shape[1] or packed.shape[2] != PANEL:
            raise ValueError(
                f"the packed weight {tuple(packed.shape)} does not match the input's "
                f"{x.shape[1]} features"
            )
        x = x.contiguous()
        rows, n_in = x.shape
        out = torch.empty(rows, n_out)
        run(x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, n_in, n_out,
            torch.get_num_threads())  # fmt: skip
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> None:
        """Rotate the first ``heads`` heads of each row of ``x`` (rows, >= heads x dim) in place
        by its row of ``cos`` and ``sin`` (rows, dim): ``x * cos + rotate_half(x) * sin`` as
        transformers' Llama-family ``apply_rotary_pos_emb`` computes it, bit for bit."""
        _check_float32(x, cos, sin)
        rows, dim = cos.shape if cos.dim() == 2 else (-1, -1)
        if (
            sin.shape != cos.shape
            or x.dim() != 2
            or x.shape[0] != rows
            or dim % 2
            or x.shape[1] < heads * dim
            or x.stride(1) != 1
        ):
            raise ValueError(
                f"rope takes rows (rows, >= {heads} heads x dim) and (rows, dim) cos and sin "
                f"with an even dim; got {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}"
            )
        cos, sin = cos.contiguous(), sin.contiguous()
        self._rope(x.data_ptr(), rows, x.stride(0), heads, dim, cos.data_ptr(), sin.data_ptr(),
                   dim)  # fmt: skip

    def prefix_attention(
        self,
        query: torch.Tensor,  # (N, H, 1, d)
        prompt_kt: torch.Tensor,  # (prompts, Hkv, d, P16): held keys transposed, zero-padded
        prompt_values: torch.Tensor,  # (prompts, Hkv, P, d)
        keys: torch.Tensor,  # (N, Hkv, T, d): each row's decoded tokens
        values: torch.Tensor,  # (N, Hkv, T, d), laid out as the keys
        members: torch.Tensor,  # (prompts, width) int64: each prompt's rows, -1 after its last
        mask: torch.Tensor | None,  # (N, 1, 1, P + T): bool (True: attend) or additive
        scale: float,
    ) -> torch.Tensor | None:  # (N, 1, H, d); None where no kernel fits these shapes
        """One decode step's attention over prompts held once (the computation of
        :func:`atgrpo.generation.cpu.prefix_cache.prefix_attention`, in one call)."""
        n, heads, _, dim = query.shape
        kv_heads, prompt = prompt_values.shape[1], prompt_values.shape[2]
        f32 = (query, prompt_kt, prompt_values, keys, values)
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in f32):
            return None
        if not (prompt_kt.is_contiguous() and prompt_values.is_contiguous()):
            return None
        if keys.stride() != values.stride() or keys.stride()[2:] != (dim, 1):
            return None
        query = query.reshape(n, heads, dim).contiguous()
        rows = None if mask is None else mask[:, 0, 0, :]  # (N, P + T) view
        if rows is not None and rows.stride(-1) != 1:
            rows = rows.contiguous()
        kind = 0 if rows is None else 1 if rows.dtype == torch.bool else 2
        if rows is not None and kind == 2:
            rows = rows.float()
        out = torch.empty(n, heads, dim)
        args = _Attention(
            query.data_ptr(), prompt_kt.data_ptr(), prompt_values.data_ptr(), keys.data_ptr(),
            values.data_ptr(), members.data_ptr(), 0 if rows is None else rows.data_ptr(),
            kind, 0 if rows is None else rows.stride(0), keys.stride(0), keys.stride(1), heads,
            kv_heads, prompt, prompt_kt.shape[-1], keys.shape[2], *members.shape, scale,
            out.data_ptr(),
        )  # fmt: skip
        groups = heads // kv_heads
        if self._attend(ctypes.byref(args), groups, dim, torch.get_num_threads()):
            return None
        return out.reshape(n, 1, heads, dim)


def _check_float32(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(
                f"atgrpo's CPU kernels take float32 CPU tensors; got {t.dtype} on {t.device}"
            )


@functools.cache
def extension() -> Kernel | None:
    """The compiled kernel, or None where this CPU lacks AVX-512 or the build fails (then a
    one-line warning says why)."""
    if not cpu_supports():
        return None
    try:
        return Kernel(ctypes.CDLL(str(build())))
    except (OSError, subprocess.CalledProcessError) as err:
        warnings.warn(
            f"atgrpo: the float32 decode kernel did not build ({_reason(err)}); generation "
            "uses MKL's packed weights instead (a C++ compiler, c++ or $CXX, builds it)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def build() -> Path:
    """The kernel's shared library in atgrpo's cache, compiled there first if missing (into a
    temporary name, then renamed: a concurrent or interrupted build leaves no half file)."""
    compiler = os.environ.get("CXX", "c++")
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join([compiler, *_FLAGS]).encode())
    target = cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *_FLAGS, str(_SOURCE), "-o", tmp]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _reason(err: Exception) -> str:
    """The build error's last line: the compiler's own message where it ran."""
    text = err.stderr if isinstance(err, subprocess.CalledProcessError) else str(err)
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(err).__name__
