"""bench/bench_step.py's roofline: the bound follows the step's precision; the limits are
medians of the run's measurements."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import bench_module

bench = bench_module("bench_step")


def _summary() -> dict[str, Any]:
    return {
        "params": 1e8,
        "prefill_tokens": 0,
        "update_tokens": 1000,
        "gen_s": 1.0,
        "update_s": 1.0,
    }


def test_an_fp32_step_reads_four_bytes_a_parameter_per_decode_step() -> None:
    # Copy-bound decode (1 GB/s, a fast matmul): the weights' read is the bound.
    limits = {"matmul_gflops": 1e9, "copy_gbs": 1.0}
    bf16 = bench.roofline(_summary(), limits, "bf16")
    fp32 = bench.roofline(_summary(), limits, "fp32")
    assert bf16["decode_ms"] == pytest.approx(200.0)  # 2 bytes x 1e8 at 1 GB/s
    assert fp32["decode_ms"] == pytest.approx(400.0)
    assert fp32["gen_x_bound"] == pytest.approx(bf16["gen_x_bound"] / 2)
    assert (
        fp32["update_gflops"] == bf16["update_gflops"] == pytest.approx(600.0)
    )  # 6 x 1e8 x 1000 tokens in 1 s


def test_auto_is_atgrpo_s_own_choice_on_this_machine() -> None:
    from atgrpo.models import bf16_supported

    assert bench.resolve_precision("auto") == ("bf16" if bf16_supported() else "fp32")
    assert bench.resolve_precision("fp32") == "fp32"
    assert bench.PRECISIONS[bench.resolve_precision("auto")] in ("bf16_autocast", "fp32")


def _result(steps: list[float], rss: float = 100.0) -> dict[str, Any]:
    history = [
        {"gen_s": t / 2, "update_s": t / 2, "step_s": t, "tokens": 10.0, "faulted_mib": 0.0}
        for t in steps
    ]
    return {"history": history, "peak_rss_mib": rss, "load": [1.0, 2.0], "params": 1e8}


def test_rounds_pool_their_settled_steps_and_keep_each_round_s_own_median() -> None:
    s = bench.summarise([_result([9.0, 2.0, 4.0]), _result([9.0, 6.0, 8.0], rss=300.0)])
    assert s["step_s"] == 5.0  # median of 2, 4, 6, 8: step 1 of each round left out
    assert s["round_step_s"] == [3.0, 7.0]
    assert s["per_step"] == [[9.0, 2.0, 4.0], [9.0, 6.0, 8.0]]
    assert s["settled"] == [[2, 3], [2, 3]]
    assert s["rss"] == 300.0


def test_round_ratios_print_each_round_and_their_range(capsys: pytest.CaptureFixture) -> None:
    plain = bench.summarise([_result([1.0, 10.0]), _result([1.0, 20.0])])
    share = bench.summarise([_result([1.0, 3.0]), _result([1.0, 8.0])])
    bench.print_rounds({"plain": plain, "atgrpo-share": share})
    out = capsys.readouterr().out
    assert "atgrpo-share / plain" in out
    assert "0.300 0.400" in out and "median 0.350, range 0.300-0.400" in out


def test_variants_can_be_narrowed_and_vllm_joins_only_workload_a() -> None:
    assert bench.variants("a", False, ["plain", "atgrpo-share"]) == ("plain", "atgrpo-share")
    assert bench.variants("a", True) == (*bench.VARIANTS["a"], "atgrpo-vllm")
    assert bench.variants("b", True) == bench.VARIANTS["b"]
    assert bench.variants("b", False, ["plain"]) == ()


def test_workload_b_sums_each_generate_call_s_bound_and_takes_medians_over_steps() -> None:
    # Two steps of two calls; fp32 at 1 GB/s and 1 TFLOP/s: every decode step reads 0.4 s of
    # weights (FLOPs: 2 x 1e8 x rows = at most 6.4 ms), a prefill token costs 0.2 ms.
    limits = {"matmul_gflops": 1e3, "copy_gbs": 1.0}
    calls = [
        {"rows": 16.0, "prefill": 500.0, "steps": 10.0, "s": 6.0},  # bound 0.1 + 4.0
        {"rows": 4.0, "prefill": 0.0, "steps": 2.0, "s": 1.0},  # bound 0.8
    ]
    slower = [{**c, "s": 2 * c["s"]} for c in calls]
    s = {**_summary(), "gen_s": 99.0, "gen_calls": [calls, slower]}
    r = bench.roofline(s, limits, "fp32")
    assert r["gen_bound_s"] == pytest.approx(4.9)
    assert r["gen_s"] == pytest.approx(10.5)  # median of 7 and 14: the rollout's 99 s unused
    assert r["gen_x_bound"] == pytest.approx(10.5 / 4.9)


def test_the_limits_are_the_medians_of_the_run_s_measurements() -> None:
    samples = [{"matmul_gflops": g, "copy_gbs": c} for g, c in [(300, 20), (250, 26), (320, 22)]]
    pooled = bench.pooled_limits(samples)
    assert (pooled["matmul_gflops"], pooled["copy_gbs"]) == (300, 22)
    assert pooled["ranges"] == {"matmul_gflops": (250, 320), "copy_gbs": (20, 26)}
    assert pooled["measurements"] == 3
