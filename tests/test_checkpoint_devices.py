"""A checkpoint written on one device loads on another: a GPU run's optimizer state resumes and
evaluates on a CPU machine (its tensors mapped to the CPU, then moved to each parameter's
device), and a run's CUDA RNG states are restored onto the GPUs the machine has."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atgrpo.algo.loss import LossAggregation
from atgrpo.algo.update import UpdateSettings, ppo_update
from atgrpo.checkpoint import restore_policy_state, save_policy
from atgrpo.checkpoint.policy_dir import OPTIM_FILE, policy_dir
from atgrpo.config import load_config
from atgrpo.policies import build_policy
from conftest import REPO
from helpers import UPDATE_DEFAULTS, mixed_batch

TINY = REPO / "configs" / "tiny.yaml"
SETTINGS = UpdateSettings(
    1.0, 0.2, 0.2, LossAggregation.TOKEN_MEAN, 0.0, 0.0, 4, 1.0, **UPDATE_DEFAULTS
)


def test_optimizer_state_written_on_a_gpu_loads_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}"])
    trained = build_policy(cfg)
    ppo_update(trained, mixed_batch(trained), SETTINGS)
    checkpoint = tmp_path / "step-000001"
    with monkeypatch.context() as gpu:  # every .pt storage tagged as a CUDA device's, as on a GPU
        gpu.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        save_policy(trained, checkpoint / f"policy-{trained.policy_id}")
    optim = policy_dir(checkpoint, trained.policy_id) / OPTIM_FILE
    if not torch.cuda.is_available():  # what a plain torch.load does with it here
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(optim, weights_only=True)
    fresh = build_policy(cfg)
    restore_policy_state(checkpoint, fresh)
    want, got = trained.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert want.keys() == got.keys() and want
    for key, moments in want.items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert got[key][name].device == next(fresh.model.parameters()).device
            torch.testing.assert_close(got[key][name], moments[name], atol=0, rtol=0)
    assert fresh.scheduler.state_dict() == trained.scheduler.state_dict()
