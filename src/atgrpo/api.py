"""The Python API: train a config, evaluate a config or a checkpoint (docs/python-api.md).

``from atgrpo import Config, load_config, train, evaluate, check_env, register_env``.
"""

from __future__ import annotations

from pathlib import Path

from atgrpo import checkpoint as ckpt
from atgrpo.checkpoint import CheckpointError
from atgrpo.config import Config, ConfigError
from atgrpo.splits import Split
from atgrpo.training.evaluation import EvalReport, check_checkpoint_config
from atgrpo.training.loop import seed_everything, train
from atgrpo.training.runtime import build_runtime

__all__ = ["evaluate", "load_checkpoint", "train"]


def load_checkpoint(path: str | Path) -> Path:
    """The intact checkpoint folder ``path`` names: a checkpoint, or a run folder (its latest).

    Raises FileNotFoundError when there is none, :class:`~atgrpo.checkpoint.CheckpointError`
    when its files do not match its manifest (cut short or changed since it was written).
    """
    folder = ckpt.resolve_checkpoint(path)
    if problem := ckpt.checkpoint_problem(folder):
        raise CheckpointError(
            f"checkpoint {folder} is damaged ({problem}): evaluate another one "
            "(<run>/checkpoints/step-N) or train the run again"
        )
    return folder


def evaluate(
    cfg: Config,
    checkpoint: str | Path | None = None,
    *,
    split: Split | str = Split.TEST,
    num_tasks: int | None = None,
    force: bool = False,
) -> EvalReport:
    """Evaluate ``cfg``'s policies on up to ``num_tasks`` (default ``eval.num_tasks``) distinct
    held-out tasks of ``split`` (``test`` or ``validation``) and return the report.

    ``checkpoint`` (a checkpoint folder, or a run folder for its latest checkpoint) supplies the
    weights of every policy by its id; None evaluates the configured models untrained. Decoding is
    greedy with ``eval.samples_per_task: 1``, else avg@n and pass@k
    (:mod:`atgrpo.training.evaluation`). Everything is seeded with ``run.seed`` first, as ``atgrpo
    eval`` does; nothing is written (``atgrpo.training.evaluation.write_eval_json`` writes the
    report). A checkpoint trained with another env, model or policies than ``cfg``'s is refused
    with a :class:`~atgrpo.config.ConfigError` unless ``force``
    (:data:`~atgrpo.training.evaluation.FIXED_ON_EVAL`; ``routing`` may differ).
    """
    try:
        held_out = Split(split)
    except ValueError:
        raise ConfigError(f"split {split!r}: evaluate on 'test' or 'validation'") from None
    if held_out is Split.TRAIN:
        raise ConfigError("split 'train': evaluate on held-out tasks, 'test' or 'validation'")
    folder = None if checkpoint is None else load_checkpoint(checkpoint)
    if folder is not None:
        check_checkpoint_config(cfg, folder, force)
    seed_everything(cfg.run.seed)
    rt = build_runtime(cfg, folder, "evaluation")  # in the precision the run trained in
    try:
        return rt.evaluate(held_out, cfg.eval.num_tasks if num_tasks is None else num_tasks)
    finally:
        rt.close()
