"""Atomic, verified checkpoints and resume (invariant 7 of docs/design.md; docs/faults.md).

The one on-disk format of a run's checkpoints: :mod:`~atgrpo.checkpoint.steps` writes and
verifies the ``step-N/`` folders (atomic rename, manifest, ``latest``, resume and rewind),
:mod:`~atgrpo.checkpoint.policy_dir` each policy's ``policy-<id>/`` inside one (whole model,
LoRA adapter, or the shards of a sharded policy, which :mod:`~atgrpo.checkpoint.shards` reads
without unpickling code). Every policy is saved and restored by its id, so a checkpoint can be
evaluated with another routing (the swapped-roles ablation: ``routing.tool=planner
routing.planner=tool``).
"""

from atgrpo.checkpoint.policy_dir import (
    OPTIM_FILE,
    SCHEDULER_FILE,
    SHARDED_DIR,
    keep_weights_only,
    policy_dir,
    policy_dirs,
    restore_policy_state,
    save_policy,
    weights_digest,
    weights_only_saver,
)
from atgrpo.checkpoint.steps import (
    DISCARDED,
    LATEST,
    MANIFEST,
    WEIGHTS_ONLY,
    CheckpointError,
    PolicySaver,
    ResumeWarning,
    checkpoint_path,
    checkpoint_problem,
    checkpoint_step,
    commit_checkpoint,
    discard_after,
    latest_checkpoint,
    load_torch,
    load_trainer_state,
    resolve_checkpoint,
    restore_rng,
    resume_checkpoint,
    save_checkpoint,
    save_torch,
    weights_only_dtype,
    write_checkpoint,
)

__all__ = [
    "DISCARDED",
    "LATEST",
    "MANIFEST",
    "OPTIM_FILE",
    "SCHEDULER_FILE",
    "SHARDED_DIR",
    "WEIGHTS_ONLY",
    "CheckpointError",
    "PolicySaver",
    "ResumeWarning",
    "checkpoint_path",
    "checkpoint_problem",
    "checkpoint_step",
    "commit_checkpoint",
    "discard_after",
    "keep_weights_only",
    "latest_checkpoint",
    "load_torch",
    "load_trainer_state",
    "policy_dir",
    "policy_dirs",
    "resolve_checkpoint",
    "restore_policy_state",
    "restore_rng",
    "resume_checkpoint",
    "save_checkpoint",
    "save_policy",
    "save_torch",
    "weights_digest",
    "weights_only_dtype",
    "weights_only_saver",
    "write_checkpoint",
]
