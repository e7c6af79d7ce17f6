"""One policy's folder in a checkpoint, ``policy-<id>/``: the only code that writes or reads it.

* A whole model (L1, L3): weights (safetensors) and tokenizer, loadable by ``from_pretrained``;
  ``optim.pt`` beside them holds the optimizer and LR-scheduler state.
* A LoRA adapter alone (L2): the adapter folder of :mod:`atgrpo.adapters`; the base is not copied.
* A policy sharded over its Ray worker group (FSDP2, :mod:`atgrpo.distributed.sharding`): the
  same files from the gathered weights, but instead of ``optim.pt`` a ``sharded/`` folder with
  every rank's shards of the trainable weights and optimizer state
  (``torch.distributed.checkpoint``), loadable onto any number of ranks, one process included,
  and ``scheduler.pt`` with the LR schedule.
* A weights-only folder (``checkpoint.final: weights``, :func:`keep_weights_only`): any of the
  above without optimizer and schedule, a whole model's weights in the training dtype.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from atgrpo.adapters import ADAPTER_CONFIG, save_adapter
from atgrpo.algo.policy import Policy
from atgrpo.checkpoint.steps import MANIFEST, PolicySaver, load_torch, save_torch

OPTIM_FILE = "optim.pt"  # a replicated policy's optimizer and LR-scheduler state
SHARDED_DIR = "sharded"  # a sharded policy's torch.distributed.checkpoint
SCHEDULER_FILE = "scheduler.pt"  # beside it: the sharded policy's LR schedule (rank 0)

__all__ = [
    "OPTIM_FILE",
    "SCHEDULER_FILE",
    "SHARDED_DIR",
    "keep_weights_only",
    "policy_dir",
    "policy_dirs",
    "restore_policy_state",
    "save_policy",
    "weights_digest",
    "weights_only_saver",
]


def save_policy(policy: Policy, out: Path, *, shard_rank: int | None = None) -> str:
    """Write ``policy-<id>/``: weights (or the adapter alone), tokenizer, optimizer state.

    ``shard_rank``: this rank's index when the policy is sharded over its worker group; then the
    call is a collective that every rank of the group makes. Returns the policy's kind,
    ``"model"`` or ``"lora"``. A Ray worker group calls this on its own node
    (:mod:`atgrpo.distributed`), so the folder is written where the weights live.
    """
    if shard_rank is not None:
        _save_sharded(policy, out, shard_rank)
    else:
        _save_weights(policy, out)
        policy.tokenizer.save_pretrained(out)
        state = {"optimizer": policy.optimizer.state_dict()}
        save_torch({**state, "scheduler": policy.scheduler.state_dict()}, out / OPTIM_FILE)
    return "lora" if policy.adapter is not None else "model"


def _save_weights(policy: Policy, out: Path, state_dict: dict[str, Any] | None = None) -> None:
    """A whole model with ``save_pretrained``; an adapter alone. ``state_dict``: the weights
    gathered from a sharded policy, which are not its own parameters."""
    if policy.adapter is not None:
        save_adapter(policy.model, policy.adapter, out, state_dict)
        return
    if state_dict is None:
        policy.model.save_pretrained(out)
        return
    model = policy.model
    model.save_pretrained(out, state_dict=state_dict)
    # save_pretrained names the class it was called on: FSDP's wrapper class, not the model's.
    model.config.architectures = [_unwrapped_class(model).__name__]
    model.config.save_pretrained(out)


def _unwrapped_class(model: Any) -> type:
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def keep_weights_only(folder: Path, dtype: torch.dtype) -> None:
    """Turn a saved ``policy-<id>/`` into what serving needs: drop the optimizer, schedule and
    shards; cast a whole model's floating-point weights to ``dtype`` (its config.json says so,
    so transformers and vLLM load it in that dtype). An adapter keeps its fp32 weights (small).
    Every file it changes is written anew and renamed into place, never rewritten in place (a
    hard link to it elsewhere keeps the old content: :mod:`atgrpo.checkpoint.slim`)."""
    for name in (OPTIM_FILE, SCHEDULER_FILE):
        (folder / name).unlink(missing_ok=True)
    shutil.rmtree(folder / SHARDED_DIR, ignore_errors=True)
    config = folder / "config.json"
    if not config.is_file():
        return  # a LoRA adapter
    total = sum(_cast_weights(weights, dtype) for weights in sorted(folder.glob("*.safetensors")))
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # several weight files: their index states the total size
        listed = json.loads(index.read_text(encoding="utf-8"))
        listed.setdefault("metadata", {})["total_size"] = total
        _replace_text(index, json.dumps(listed, indent=2) + "\n")
    settings = json.loads(config.read_text(encoding="utf-8"))
    name = str(dtype).removeprefix("torch.")
    settings["dtype" if "torch_dtype" not in settings else "torch_dtype"] = name
    _replace_text(config, json.dumps(settings, indent=2, sort_keys=True) + "\n")


def _cast_weights(weights: Path, dtype: torch.dtype) -> int:
    """Cast one safetensors file's floating-point tensors to ``dtype`` (left as it is when they
    are already); returns its tensors' bytes."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(weights), framework="pt") as f:
        metadata = f.metadata() or {"format": "pt"}
    loaded = load_file(str(weights))
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in loaded.items()}
    if any(tensors[k].dtype != v.dtype for k, v in loaded.items()):
        tmp = weights.with_name(weights.name + ".tmp")  # the loaded tensors may map the file
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(weights)
    return sum(v.numel() * v.element_size() for v in tensors.values())


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def weights_only_saver(save: PolicySaver, dtype: torch.dtype) -> PolicySaver:
    """``save``, then :func:`keep_weights_only` on the folder it wrote: for the final
    checkpoint of ``checkpoint.final: weights``, from this process or a Ray worker group."""

    def saver(out: Path) -> str:
        kind = save(out)
        keep_weights_only(out, dtype)
        return kind

    return saver


def policy_dir(checkpoint: Path, policy_id: str) -> Path:
    path = checkpoint / f"policy-{policy_id}"
    if not ((path / "config.json").is_file() or (path / ADAPTER_CONFIG).is_file()):
        saved = sorted(p.name.removeprefix("policy-") for p in checkpoint.glob("policy-*"))
        raise FileNotFoundError(
            f"checkpoint {checkpoint} has no policy {policy_id!r} (it has: {', '.join(saved)})"
        )
    if (path / SHARDED_DIR).is_dir():  # read before anything loads, evaluation included
        from atgrpo.checkpoint.shards import read_metadata

        read_metadata(path / SHARDED_DIR)  # a crafted one is refused: nothing in it runs
    return path


def policy_dirs(checkpoint: Path, policy_ids: list[str]) -> dict[str, Path]:
    """The saved folder of every policy in ``policy_ids``; a missing one raises."""
    return {pid: policy_dir(checkpoint, pid) for pid in policy_ids}


def weights_digest(checkpoint: Path) -> str | None:
    """One SHA-256 over the manifest's digests of every policy's model (weights, config,
    tokenizer; not its optimizer, schedule or shards): equal for two checkpoints that hold the
    same policies, whatever else differs (a retrained run's differs). None for a checkpoint
    without a manifest (written by an older atgrpo)."""
    try:
        files = json.loads((checkpoint / MANIFEST).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        return None
    kept = sorted(
        f"{name} {entry['sha256']}\n" for name, entry in files.items() if _is_weights(name)
    )
    return hashlib.sha256("".join(kept).encode()).hexdigest()


def _is_weights(name: str) -> bool:
    parts = name.split("/")
    return (
        parts[0].startswith("policy-")
        and SHARDED_DIR not in parts
        and parts[-1] not in (OPTIM_FILE, SCHEDULER_FILE)
    )


def restore_policy_state(checkpoint: Path, policy: Policy) -> None:
    """Load optimizer and scheduler state (the weights are loaded with from_pretrained).

    A sharded policy's folder (``sharded/``) loads onto this policy whatever its layout: the
    shards of N ranks onto M, or into one process (weights and optimizer state both).
    """
    folder = policy_dir(checkpoint, policy.policy_id)
    if (folder / SHARDED_DIR).is_dir():
        _load_sharded(folder, policy)
        return
    saved = load_torch(folder / OPTIM_FILE)
    policy.optimizer.load_state_dict(saved["optimizer"])
    policy.scheduler.load_state_dict(saved["scheduler"])


# -- sharded policies (torch.distributed.checkpoint; imported only when one is saved or read) --


def _trainable_state(policy: Policy) -> tuple[dict[str, Any], dict[str, Any]]:
    """The policy's trainable weights and optimizer state as FQN-keyed (sharded) dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    policy.activate()  # L2: this adapter trainable, the others and the base frozen
    options = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = get_state_dict(policy.model, policy.optimizer, options=options)
    return model_sd, optim_sd


def _save_sharded(policy: Policy, out: Path, rank: int) -> None:
    """Every rank its shards; rank 0 also the full weights, tokenizer and schedule."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(
        policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )  # gathered onto rank 0 (in CPU memory) one tensor at a time; empty on the others
    if rank == 0:
        _save_weights(policy, out, full)
        policy.tokenizer.save_pretrained(out)
        save_torch({"scheduler": policy.scheduler.state_dict()}, out / SCHEDULER_FILE)
    del full
    dist.barrier()  # the folder exists before the shards go in
    model_sd, optim_sd = _trainable_state(policy)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / SHARDED_DIR))
    dist.barrier()  # every rank's shards are written before the driver commits the checkpoint


def _load_sharded(folder: Path, policy: Policy) -> None:
    """Any layout: the shards of N ranks onto M ranks of a sharded group, or into one process."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from atgrpo.checkpoint.shards import load_shards

    model_sd, optim_sd = _trainable_state(policy)
    state = {"model": model_sd, "optim": optim_sd}
    alone = not (dist.is_available() and dist.is_initialized())  # one process: no collectives
    load_shards(state, folder / SHARDED_DIR, no_dist=alone)  # no pickled code runs
    set_state_dict(
        policy.model,
        policy.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(ignore_frozen_params=True),
    )
    saved = load_torch(folder / SCHEDULER_FILE)
    policy.scheduler.load_state_dict(saved["scheduler"])
