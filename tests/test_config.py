"""Config loading: defaults, overrides, and one-line errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from atgrpo.advantage import Grouping
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
    ],
)
def test_bad_keys_and_values_fail_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs" / "tiny.yaml", [override])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


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
    out = capsys.readouterr().out
    assert "unknown config key 'train.stepz'" in out
    assert "Traceback" not in out
