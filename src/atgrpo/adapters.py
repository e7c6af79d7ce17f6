"""The LoRA adapter folder: its file names, the one writer and the one reader.

An adapter folder is what peft's ``save_pretrained`` writes for one named adapter, and nothing
else: ``adapter_config.json`` and ``adapter_model.safetensors`` (no base weights, no model
card), loadable by ``PeftModel.from_pretrained(base, folder)``. A checkpoint's ``policy-<id>/``
of an L2 policy is one (:mod:`atgrpo.checkpoint`), and so is each adapter version the vLLM
engine loads after an update (:mod:`atgrpo.generation.vllm`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from atgrpo.models import ModelError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_parameters",
    "load_adapter_weights",
    "save_adapter",
]


def save_adapter(
    model: Any, adapter: str, folder: Path, state_dict: dict[str, Any] | None = None
) -> None:
    """Write ``model``'s adapter ``adapter`` alone into the new folder ``folder``.

    ``state_dict``: the model's full weights when they are not its own parameters (gathered
    from a sharded model, :mod:`atgrpo.distributed.sharding`).
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    # peft writes an adapter into <dir>/<name>/ (into <dir> itself when the name is "default"),
    # beside a model card; keep only the adapter's files.
    with tempfile.TemporaryDirectory(prefix=f".adapter-{adapter}-", dir=folder.parent) as tmp:
        kwargs = {} if state_dict is None else {"state_dict": state_dict}
        model.save_pretrained(tmp, selected_adapters=[adapter], **kwargs)
        saved = Path(tmp) if adapter == "default" else Path(tmp) / adapter
        folder.mkdir()
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            os.replace(saved / name, folder / name)


def adapter_parameters(model: Any, adapter: str) -> list[torch.nn.Parameter]:
    """The parameters of one named adapter: its entries in every tuner layer of ``model``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    params: list[torch.nn.Parameter] = []
    for module in model.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for layer_name in module.adapter_layer_names:
            layers = getattr(module, layer_name)
            if adapter in layers:
                item = layers[adapter]
                params.extend([item] if isinstance(item, torch.nn.Parameter) else item.parameters())
    if not params:
        raise ValueError(f"adapter {adapter!r} has no parameters: check lora.target_modules")
    return params


def load_adapter_weights(model: Any, adapter: str, folder: Path) -> None:
    """Load a saved adapter folder into ``model``'s adapter ``adapter``; a file that is missing
    or does not fit the adapter (other lora settings) raises :class:`ModelError`."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = folder / ADAPTER_WEIGHTS
    if not file.is_file():
        raise ModelError(
            f"{folder} holds no LoRA adapter ({ADAPTER_WEIGHTS}) but policy {adapter!r} is a "
            "LoRA policy; check that the config matches the checkpoint's run"
        )
    result: Any = set_peft_model_state_dict(model, load_file(str(file)), adapter_name=adapter)
    own = {id(p) for p in adapter_parameters(model, adapter)}
    missing = set(result.missing_keys) & {n for n, p in model.named_parameters() if id(p) in own}
    if result.unexpected_keys or missing:
        raise ModelError(
            f"adapter {folder} does not fit policy {adapter!r} (other lora settings?): "
            f"{len(missing)} of its tensors missing, {len(result.unexpected_keys)} unexpected"
        )
