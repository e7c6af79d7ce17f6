"""The CPU decode engine as the HF engine enters it: one :class:`CpuEngine` per model.

Its parts, each chosen once for the model and each computing what transformers' own path
computes (the same logits; with atgrpo's kernels, equal to float rounding):

* the linear layers on weights packed once per rollout (:mod:`atgrpo.generation.cpu.packed`);
* in float32 on a CPU with AVX-512, atgrpo's kernels (:mod:`atgrpo.generation.cpu.kernels`) for
  those layers, the norms, MLPs and attention inputs (:mod:`atgrpo.generation.cpu.fused`), the
  attention over prompts held once and the sampler's log-softmax;
* each prompt's keys and values held once while its K rows decode
  (:mod:`atgrpo.generation.cpu.prefix_cache`).

The HF engine builds none of it with ``rollout.cpu_kernels: off`` (plain transformers and the
sampler) or off CPU. :meth:`CpuEngine.decode_path` names the path decoding takes (the run's
header line).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from atgrpo.generation.cpu import fused, kernels
from atgrpo.generation.cpu.kernels import Kernel
from atgrpo.generation.cpu.packed import PackedLinears
from atgrpo.generation.cpu.packed import supported as packing_supported
from atgrpo.generation.cpu.prefix_cache import reads_prompt_once, shared_prefix
from atgrpo.generation.sampler import LogSoftmaxExp


class CpuEngine:
    """The CPU decode engine for one model on CPU, ``autocast_dtype`` its generation's autocast.

    ``prompt_once``: hold each prompt's keys and values once while decoding, where
    :func:`reads_prompt_once` allows; False copies them to every row (the same attention).
    ``pack_weights``: run the linear layers on weights packed once for oneDNN (bf16 autocast) or
    MKL (float32); False: the layers' own calls. ``decode_kernel``: in float32 on a CPU with
    AVX-512, atgrpo's kernels (equal to torch's to rounding); False keeps MKL's packed sgemm
    and torch's operators (bit for bit the unpacked layers'). The three are for measuring the
    parts; a run turns them all on or off with ``rollout.cpu_kernels``.
    """

    def __init__(
        self,
        model: Any,
        autocast_dtype: torch.dtype | None,
        *,
        prompt_once: bool = True,
        pack_weights: bool = True,
        decode_kernel: bool = True,
    ) -> None:
        self.model = model
        self.autocast_dtype = autocast_dtype
        self.prompt_once = prompt_once
        self.decode_kernel = decode_kernel and autocast_dtype is None
        self.packed = (
            PackedLinears(autocast_dtype, decode_kernel)
            if pack_weights and packing_supported(model, autocast_dtype)
            else None
        )
        if self.packed is not None:
            self.packed.drop_at_training_forward(model)

    def kernel(self) -> Kernel | None:
        """atgrpo's CPU kernels, where ``decode_kernel`` asks for them and they run here (built
        at the first call)."""
        return kernels.extension() if self.decode_kernel else None

    def log_softmax_exp(self) -> LogSoftmaxExp | None:
        """The sampler's float32 log-softmax on the kernel, where it runs."""
        kernel = self.kernel()
        return kernel.log_softmax_exp if kernel is not None else None

    @contextlib.contextmanager
    def layers(self) -> Iterator[None]:
        """The linear layers on packed weights (``pack_weights``) and, where the kernels run,
        norms, MLPs and attentions on them, their layers of one input packed together."""
        packed, kernel = self.packed, self.kernel()
        with contextlib.ExitStack() as stack:
            together = None
            if packed is not None:
                groups = fused.groups(self.model) if kernel else []
                together = stack.enter_context(packed.active(self.model, groups))
            if kernel:
                stack.enter_context(fused.active(self.model, kernel, together))
            yield

    def hold_prompts_once(self, cache: Any, rows: torch.Tensor) -> Any | None:
        """``cache`` (one row per distinct prompt) holding each prompt once for the N rows
        ``rows`` (each row's prompt), or None where that does not apply (``prompt_once`` off,
        :func:`reads_prompt_once` false): the caller then copies the rows."""
        if not self.prompt_once or not reads_prompt_once(self.model, self.autocast_dtype, cache):
            return None
        return shared_prefix(cache, rows, self.kernel())

    def refresh(self) -> None:
        """The model has new weights: drop the packed copies of the old ones."""
        if self.packed is not None:
            self.packed.clear()

    @staticmethod
    def decode_path(autocast_dtype: torch.dtype | None) -> str:
        """The path a decode step takes on this CPU, in a few words: atgrpo's kernels, or torch
        and why not the kernels (their build is tried here, once per process, as generation
        would)."""
        if autocast_dtype is not None:
            dtype = str(autocast_dtype).removeprefix("torch.")
            return f"torch under {dtype} autocast (atgrpo's kernels are float32)"
        if not kernels.cpu_supports():
            return "torch (this CPU has no AVX-512)"
        if kernels.extension() is None:
            return "torch (atgrpo's AVX-512 kernels did not build)"
        return "atgrpo AVX-512 kernels"
