"""``atgrpo estimate``: hand-computed figures for the tiny model and Qwen3, the command's output
and exit codes, and the estimate against the measured peak RSS of one tiny update on CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from atgrpo.cli import main
from atgrpo.config import ConfigError, load_config
from atgrpo.generation import memory
from atgrpo.training.estimate import (
    CPU_PROCESS_BYTES,
    GIB,
    activation_bytes_per_token_layer,
    estimate,
    lora_params,
    model_shape,
    parse_size,
)
from conftest import REPO

TINY = REPO / "configs" / "tiny.yaml"
# tiny-random-llama: vocabulary 259, hidden 128, 2 layers, 4 heads, 2 kv heads (head dim 32),
# intermediate 256, tied embeddings.
TINY_PARAMS = 328_704  # 259 x 128 + 2 x 147,712 + 128 (below)


def test_parameter_counts_from_the_shape() -> None:
    tiny = model_shape("tiny-random-llama")
    # one layer: q 128 x 128 + k 128 x 64 + v 128 x 64 + o 128 x 128 = 49,152; MLP 3 x 128 x 256
    # = 98,304; two norms 256: 147,712
    assert tiny.layer_params == 147_712
    assert tiny.params == TINY_PARAMS
    # LoRA r 8 on q, k, v, o: 8 x ((128 + 128) + (128 + 64) x 2 + (128 + 128)) = 7,168 a layer
    assert lora_params(tiny, 8, ["q_proj", "k_proj", "v_proj", "o_proj"]) == 14_336
    # Qwen3-1.7B from the built-in table (no config.json here): embedding 151,936 x 2,048 =
    # 311,164,928 (tied); a layer 2 x 2,048^2 + 2 x 2,048 x 1,024 + 3 x 2,048 x 6,144 + norms
    # 2 x 2,048 + 2 x 128 = 50,336,000; x 28 + final norm 2,048
    qwen = model_shape("Qwen/Qwen3-1.7B")
    assert qwen.params == 311_164_928 + 28 * 50_336_000 + 2_048 == 1_720_574_976


def test_tiny_update_and_rollout_by_hand() -> None:
    found = estimate(load_config(TINY), memory_bytes=80 * GIB)
    rollout, update, checkpoint = (row.parts for row in found.rows)
    assert update.weights == 4 * TINY_PARAMS  # fp32
    assert update.grads == 4 * TINY_PARAMS
    assert update.adamw == 8 * TINY_PARAMS  # two fp32 moments
    # one layer keeps 6 x 128 + 2 x (4 + 2 x 2) x 32 + 4 x 32 + 4 x 256 = 2,432 fp32 values a token
    config = model_shape("tiny-random-llama").config
    assert activation_bytes_per_token_layer(config, 4) == 9_728
    # a micro-batch of 4 x (2,048 prompt + 24 new) = 8,288 tokens; without checkpointing:
    # 2 layers x 9,728 + the ends (3 x 4 x 128 + 9,728 = 11,264) = 30,720 bytes a token
    assert update.activations == 8_288 * 30_720
    # with it: each layer's fp32 input 2 x 4 x 128, one recomputed layer 9,728, the ends
    assert update.activations_other == 8_288 * (1_024 + 9_728 + 11_264)
    # one log-prob chunk: min(1,024, 4 x 24) = 96 positions x 259 x 4 bytes x 3 copies
    assert update.logits == 298_368
    # rollout: 8 prompts in one call (auto on 80 GiB); a row caches 2 x 2 layers x 2 kv heads x
    # 32 x 4 bytes = 1,024 bytes a token x 2,072 tokens, plus 3 x 4 x 259 bytes of logits
    assert rollout.cache == 8 * (1_024 * 2_072 + 3_108)
    assert checkpoint.activations == checkpoint.cache == 0
    assert found.disk_per_checkpoint == 12 * TINY_PARAMS  # fp32 weights + AdamW's moments
    assert found.fits


def test_vllm_share_sleeps_through_the_update_on_a_gpu() -> None:
    # 0.3 x 80 GiB = 24 GiB reserved for the rollout; asleep (auto on a GPU) in the update
    awake, asleep = (
        estimate(load_config(TINY, ["rollout.engine=vllm", *extra]), memory_bytes=80 * GIB)
        for extra in (["rollout.vllm.sleep_mode=false"], [])
    )
    assert [row.parts.cache for row in awake.rows] == [int(0.3 * 80 * GIB)] * 3
    assert [row.parts.cache for row in asleep.rows] == [int(0.3 * 80 * GIB), 0, 0]


def test_auto_rule_is_the_engine_rule() -> None:
    # 10 rows of 100 bytes on a device of 1,000 bytes holding 300: (500 - 300) // 100 = 2
    assert memory.rows_for_budget(10, 100, 1_000, 300) == 2
    assert memory.rows_for_budget(10, 100, 1_000, 900) == 1  # never fewer than one
    assert memory.state_bytes(trainable=10, frozen=5, dtype_bytes=4) == (40 + 5) * 4


def test_sizes() -> None:
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("141GB") == 141 * 10**9
    assert parse_size("0.5 TiB") == 2**39
    with pytest.raises(ConfigError, match="--gpu-memory"):
        parse_size("80")


def test_cli_prints_one_row_per_group_and_phase(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(REPO / "configs" / "tiny-per_role.yaml")
    assert main(["estimate", config, "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "in GiB (2^30 bytes), against 80.0 GiB" in out[0]
    assert out[1].split()[:4] == ["device", "policies", "phase", "weights"]
    rows = [line.split() for line in out[2:8]]
    assert [(r[1], r[2]) for r in rows] == [
        (policy, phase)
        for policy in ("tool", "planner")
        for phase in ("rollout", "update", "checkpoint")
    ]
    assert all(r[-1] == "yes" for r in rows)
    assert out[8].startswith("disk: ")
    assert out[-1].startswith("fits:")


def test_cli_names_the_knob_when_it_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    # The tiny update without checkpointing: 0.5 GiB of CUDA context + 16 x 328,704 bytes of
    # training state + 8,288 tokens x 30,720 bytes of activations = 0.742 GiB; with it 8,288 x
    # 22,016 bytes: 0.675 GiB, within 0.7 GiB.
    args = ["estimate", str(TINY), "--gpu-memory", "0.7GiB"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "does not fit: local needs" in out
    assert "  model.gradient_checkpointing=true train.share_prefix=false   (peak 0.68 GiB)" in out


def test_bad_gpu_memory_is_one_line_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", str(TINY), "--gpu-memory", "eighty"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: --gpu-memory 'eighty': give a size with its unit")


def test_unknown_model_names_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", str(TINY), "model.path=org/unknown-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "set model.path" in err


_MEASURE = """
import resource, sys, torch
from atgrpo.algo.records import Sample
from atgrpo.algo.update import ppo_update
from atgrpo.config import load_config
from atgrpo.policies import build_policies
from atgrpo.training.settings import update_settings
cfg = load_config(sys.argv[1], sys.argv[2:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # the process before a model
policies = build_policies(cfg)
gen = torch.Generator().manual_seed(0)
rollout = cfg.rollout
for _ in range(2):  # the second round runs with every policy's AdamW moments in memory
    for pid, policy in policies.items():
        vocab = policy.model.config.vocab_size
        samples = [  # every prompt and response at the config's caps, distinct prompts
            Sample(0, k, "planner", 0, k, pid,
                   torch.randint(3, vocab, (rollout.max_prompt_tokens,), generator=gen).tolist(),
                   torch.randint(3, vocab, (rollout.max_new_tokens,), generator=gen).tolist(),
                   [-1.0] * rollout.max_new_tokens, 0.0, 0.0, 0.0, True, advantage=(-1.0) ** k)
            for k in range(rollout.num_tasks * rollout.num_generations)
        ]
        assert not ppo_update(policy, samples, update_settings(cfg)).skipped
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _measured_and_estimated(config: str, overrides: list[str]) -> tuple[int, int]:
    """Peak RSS over two updates of every policy in turn in a fresh process (a first update
    allocates AdamW's moments only at its step, after the activations are freed; the second
    round holds every policy's throughout, as training does), and the update phase's estimate
    (bytes) with its process constant replaced by this process's own resident memory before
    any model: that baseline differs between machines and venvs (0.33 to 0.6 GiB seen here),
    the model's part is what the formulas claim."""
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, config, *overrides],
        capture_output=True,
        text=True,
        check=True,
    )
    found = estimate(load_config(config, overrides))
    baseline, peak = (int(x) for x in run.stdout.split()[-2:])
    return peak, found.device_totals()[("local", "update")] - CPU_PROCESS_BYTES + baseline


# Slow tier: a fresh process's resident memory before any model (ru_maxrss after the imports)
# ranged 0.33-0.64 GiB between venvs and runs on one machine, most of the tiny update's peak,
# so in the default tier the bound would test that noise, not the formulas.
@pytest.mark.slow
@pytest.mark.parametrize("prompt_tokens", [512, 2048])
def test_estimate_within_25_percent_of_a_measured_update(prompt_tokens: int) -> None:
    """One tiny update in a fresh process, against the update phase's estimate on CPU. The
    process itself (its own baseline, measured in it) is most of it: the model's part is 0.06
    GiB at 512 prompt tokens and 0.24 GiB at 2,048 (estimated 10 % under the measurement)."""
    peak, estimated = _measured_and_estimated(
        str(TINY), [f"rollout.max_prompt_tokens={prompt_tokens}"]
    )
    assert abs(estimated - peak) <= 0.25 * peak, (estimated / GIB, peak / GIB)


# SmolLM2-135M in fp32, 4 responses after 64-token prompts, one micro-batch, prompts recomputed
SMOLLM2 = [
    *("model.precision=fp32", "rollout.max_prompt_tokens=64", "rollout.num_tasks=1"),
    *("rollout.num_generations=4", "train.micro_batch_size=4", "train.share_prefix=false"),
]


@pytest.mark.slow
@pytest.mark.parametrize("new_tokens", [256, 512])
@pytest.mark.parametrize(
    "config", ["plan_path-mas.yaml", "plan_path-mas-lora.yaml", "plan_path-mas-per_role.yaml"]
)
def test_smollm2_estimate_within_25_percent(config: str, new_tokens: int) -> None:
    """Shared, LoRA per role (one base) and a model per role (two in the process):
    docs/results/memory.md ("atgrpo estimate on the GPU configs") has the figures."""
    overrides = [*SMOLLM2, f"rollout.max_new_tokens={new_tokens}"]
    peak, estimated = _measured_and_estimated(str(REPO / "configs" / config), overrides)
    print(f"{config} {new_tokens}: measured {peak / GIB:.2f} GiB, estimated {estimated / GIB:.2f}")
    assert abs(estimated - peak) <= 0.25 * peak, (estimated / GIB, peak / GIB)
