"""bench/bench_packing.py: both layouts alternate on one model state, and the ratios add up."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import atgrpo.algo.prefix as prefix
from atgrpo.config import load_config
from atgrpo.policies import build_policies
from conftest import REPO, bench_module

bench = bench_module("bench_packing")


def test_layouts_alternate_on_the_same_weights(tmp_path: Path, capsys: Any) -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"run.output_dir={tmp_path}"])
    policy = next(iter(build_policies(cfg).values()))
    before = [p.detach().clone() for p in policy.params]
    seen: list[tuple[bool, bool]] = []

    def update(policy: Any, samples: Any, settings: Any) -> None:
        same = all(torch.equal(p, b) for p, b in zip(policy.params, before, strict=True))
        seen.append((bool(prefix.PACKABLE), same))
        with torch.no_grad():  # a step that moves the weights
            for p in policy.params:
                p.add_(1.0)

    packable = prefix.PACKABLE
    bench.alternate(update, policy, [], None, rounds=3)
    assert prefix.PACKABLE is packable  # put back
    assert [packed for packed, _ in seen] == [True, False, False, True, True, False]
    assert all(same for _, same in seen)  # every update started from the same weights
    assert all(torch.equal(p, b) for p, b in zip(policy.params, before, strict=True))
    out = capsys.readouterr().out
    assert "packed / padded, rounds 2-:" in out and out.count("padded  s:") == 1


def test_report_takes_ratios_from_the_second_round(capsys: Any) -> None:
    bench.report({"padded": [9.0, 10.0, 8.0], "packed": [1.0, 8.0, 6.0]})
    assert "0.800 0.750; median 0.775, range 0.750-0.800" in capsys.readouterr().out


def test_one_round_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_packing.py", "--rounds", "1"])
    with pytest.raises(SystemExit):
        bench.main()
