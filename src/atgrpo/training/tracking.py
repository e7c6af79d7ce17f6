"""Where a run's metrics go: the loggers of ``run.loggers``, fanned out by :class:`Loggers`.

Every logger receives the same ``(step, metrics)`` records with the same namespaced names
(docs/outputs.md): ``console`` prints one summary line per training step, ``jsonl`` appends to
``<run_dir>/metrics.jsonl`` (what ``atgrpo report`` reads), ``tensorboard`` writes event files
under ``<run_dir>/tensorboard/`` and ``wandb`` logs a Weights & Biases run named ``run.name``
(offline by default: no network, ``wandb sync`` uploads it later). :func:`build_loggers` makes
them once from the config, so the loop calls ``loggers.log(step, metrics)`` and nothing else.
The optional backends are imported only when asked for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from atgrpo.config import Config, ConfigError, LoggerKind
from atgrpo.training.closers import close_all
from atgrpo.training.metrics import step_summary


class MetricLogger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """One JSON line per record, ``{"step": ..., <name>: <value>, ...}``; NaN and inf as null."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        # Opened per record so that a killed run loses at most the line being written.
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")

    def close(self) -> None:
        pass


class ConsoleLogger:
    """The per-step summary line (:func:`atgrpo.training.metrics.step_summary`).

    Only training-step records are printed (they carry ``perf/step_s``); evaluation records
    are the caller's to present (``atgrpo train`` prints its reports after training). The line
    goes through ``write``, ``print`` by default: under a rich progress bar stdout is redirected
    above the bar, so the bar survives.
    """

    def __init__(self, total_steps: int, write: Callable[[str], None] | None = None) -> None:
        self.total_steps = total_steps
        self.write = write or _print_line

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "perf/step_s" not in metrics:
            return
        agents = tuple(
            k.split("/")[1] for k in metrics if k.startswith("reward/") and k.endswith("/mean")
        )
        self.write(step_summary(step, self.total_steps, metrics, agents))

    def close(self) -> None:
        pass


def _print_line(line: str) -> None:
    print(line, flush=True)


class TensorBoardLogger:
    """``add_scalar(name, value, step)`` for every metric, into ``log_dir``; ``purge_from``: the
    first step a resumed run logs again."""

    def __init__(self, log_dir: Path, purge_from: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is a dependency; a broken install lands here
            raise ConfigError(
                f"run.loggers: tensorboard needs the tensorboard package ({exc}): "
                "pip install tensorboard"
            ) from exc
        # purge_step: TensorBoard hides the older files' events from that step on (a resume).
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_from)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a TensorBoard watching the run sees every step as it ends

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run named ``run.name``, its files under ``<run_dir>/wandb/``."""

    def __init__(self, cfg: Config) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(
                'run.loggers: wandb needs the wandb package: pip install -e ".[wandb]"'
            ) from exc
        settings = cfg.run.wandb
        self.run: Any = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=cfg.run.name,
            mode=settings.mode.value,
            dir=str(cfg.run_dir),
            config=cfg.model_dump(mode="json"),
            # Our console line and progress bar own the terminal: no stdout capture, no banner.
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


@dataclass
class Loggers:
    """Every configured logger; one call logs to all of them."""

    loggers: list[MetricLogger]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def close(self) -> None:
        close_all([logger.close for logger in self.loggers])


def build_loggers(cfg: Config, purge_from: int | None = None) -> Loggers:
    """The loggers of ``run.loggers`` (each kind once), writing under ``cfg.run_dir``.

    ``purge_from``: a resumed run logs again from that step (TensorBoard drops the older events
    of those steps; the run cuts metrics.jsonl itself).
    """
    built: list[MetricLogger] = []
    try:
        for kind in dict.fromkeys(cfg.run.loggers):
            built.append(make_logger(LoggerKind(kind), cfg, purge_from))
    except BaseException:
        close_all([logger.close for logger in built])
        raise
    return Loggers(built)


def make_logger(kind: LoggerKind, cfg: Config, purge_from: int | None = None) -> MetricLogger:
    if kind is LoggerKind.CONSOLE:
        return ConsoleLogger(cfg.train.steps)
    if kind is LoggerKind.JSONL:
        return JsonlLogger(cfg.run_dir / "metrics.jsonl")
    if kind is LoggerKind.TENSORBOARD:
        return TensorBoardLogger(cfg.run_dir / "tensorboard", purge_from)
    if kind is LoggerKind.WANDB:
        return WandbLogger(cfg)
    raise ValueError(f"unknown logger {kind!r}")
