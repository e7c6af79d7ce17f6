"""Config loading: defaults, overrides, and one-line errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from atgrpo.algo.advantage import Grouping
from atgrpo.cli import main
from atgrpo.config import ConfigError, load_config
from conftest import REPO


def test_every_shipped_config_loads() -> None:
    # configs/compare/ holds method lists for `atgrpo compare`, not training configs.
    configs = sorted(
        p for p in (REPO / "configs").rglob("*.yaml") if "compare" not in p.relative_to(REPO).parts
    )
    assert configs
    for path in configs:
        load_config(path)


def test_overrides_are_typed() -> None:
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["train.lr=3e-4", "algo.grouping=agent"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.algo.grouping is Grouping.AGENT


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lrr=1", "unknown config key 'train.lrr' (did you mean 'train.lr'?)"),
        ("env.grid_sise=4", "unknown config key 'env.grid_sise' (did you mean 'env.grid_size'?)"),
        ("algo.grouping=agent_turns", "invalid value for 'algo.grouping'"),
        ("rollout.num_generations=0", "invalid value for 'rollout.num_generations'"),
        ("train.steps=many", "invalid value for 'train.steps'"),
        ("nonsense", "not of the form key=value"),
        # Range checks: these were accepted silently.
        ("algo.alpha=-3", "invalid value for 'algo.alpha'"),
        ("algo.alpha=1.5", "invalid value for 'algo.alpha'"),
        ("algo.clip_low=5", "invalid value for 'algo.clip_low'"),
        ("algo.clip_high=0", "invalid value for 'algo.clip_high'"),
        ("rollout.num_generations=1", "invalid value for 'rollout.num_generations'"),
        ("rollout.top_k=-1", "invalid value for 'rollout.top_k'"),
        ("rollout.top_p=0", "invalid value for 'rollout.top_p'"),
        ("rollout.top_p=1.5", "invalid value for 'rollout.top_p'"),
        ("train.min_lr_ratio=2", "invalid value for 'train.min_lr_ratio'"),
        ("algo.adv_std=sample", "invalid value for 'algo.adv_std'"),
        ("algo.team_credit=later", "invalid value for 'algo.team_credit'"),
    ],
)
def test_bad_keys_and_values_fail_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs" / "tiny.yaml", [override])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_k_of_one_is_refused_only_where_groups_would_be_singletons() -> None:
    with pytest.raises(ConfigError, match="K = 1 gives every sample advantage 0"):
        load_config(None, ["rollout.num_generations=1"])  # agent_turn
    load_config(None, ["rollout.num_generations=1", "algo.grouping=agent"])  # pools the turns


def test_gradient_checkpointing_needs_prefix_sharing_off() -> None:
    with pytest.raises(ConfigError, match=r"train\.share_prefix=false"):
        load_config(None, ["model.gradient_checkpointing=true"])
    load_config(None, ["model.gradient_checkpointing=true", "train.share_prefix=false"])


def test_truncated_importance_sampling_needs_trainer_old_logprobs() -> None:
    with pytest.raises(ConfigError, match=r"algo\.tis_cap"):
        load_config(None, ["algo.tis_cap=2", "algo.old_logprobs=rollout"])
    assert load_config(None, ["algo.tis_cap=2"]).algo.tis_cap == 2.0


def test_defaults_match_the_reference() -> None:
    cfg = load_config(None)
    assert (cfg.rollout.top_k, cfg.rollout.top_p) == (0, 1.0)  # sampling is not truncated
    assert cfg.algo.adv_std == "unbiased"
    assert (cfg.train.warmup_steps, cfg.train.schedule, cfg.train.min_lr_ratio) == (
        10,
        "cosine",
        0.3,
    )
    assert cfg.algo.old_logprobs == "trainer" and cfg.algo.team_credit == "lookahead"


def test_trajectory_grouping_needs_independent_sampling() -> None:
    with pytest.raises(ConfigError, match="sampling=independent"):
        load_config(None, ["algo.grouping=trajectory"])
    load_config(None, ["algo.grouping=trajectory", "rollout.sampling=independent"])


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_cli_reports_a_bad_key_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", str(REPO / "configs" / "tiny.yaml"), "train.stepz=3"])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown config key 'train.stepz'" in err
    assert "Traceback" not in err


def test_two_ranks_of_a_group_cannot_share_a_gpu() -> None:
    ray = ["backend.kind=ray", "backend.policies.shared.num_workers=2"]
    with pytest.raises(ConfigError, match=r"backend\.policies\.shared\.num_gpus.*NCCL"):
        load_config(REPO / "configs" / "tiny.yaml", [*ray, "backend.policies.shared.num_gpus=0.5"])
    load_config(REPO / "configs" / "tiny.yaml", [*ray, "backend.policies.shared.num_gpus=1"])
    one = ["backend.kind=ray", "backend.policies.shared.num_gpus=0.5"]  # one rank may share
    load_config(REPO / "configs" / "tiny.yaml", one)
