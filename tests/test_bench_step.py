"""bench/bench_step.py's roofline: the bound follows the step's precision."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from conftest import REPO


def _module() -> Any:
    path = REPO / "bench" / "bench_step.py"
    spec = importlib.util.spec_from_file_location("bench_step", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _module()


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
