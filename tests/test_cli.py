"""The command line around its subcommands: overrides anywhere on the line, every error one line
on stderr naming the problem and the fix (a full disk, no permission, a model folder without a
tokenizer or weights, a damaged checkpoint), --verbose for the traceback, --version, and user
values printed as they are (no rich markup)."""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from atgrpo import __version__
from atgrpo.cli import main
from atgrpo.config_docs import describe
from atgrpo.models import prepare_tiny_model
from conftest import REPO

TINY = str(REPO / "configs" / "tiny.yaml")
LORA = str(REPO / "configs" / "tiny-lora.yaml")
FAST = ["rollout.max_prompt_tokens=2048", "rollout.max_new_tokens=8"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"atgrpo {__version__}\n"


def test_values_are_printed_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "config", TINY, "run.name=a[bold]b[/]")
    assert code == 0 and err == "" and "  name: a[bold]b[/]\n" in out


def test_overrides_may_follow_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "config", TINY, "--verbose", "run.name=late", "run.seed=7")
    assert code == 0 and "  name: late\n" in out and "  seed: 7\n" in out
    # eval takes them after --checkpoint: the checkpoint is what fails here, not the line.
    code, out, err = _run(capsys, "eval", TINY, "--checkpoint", "nope", "routing.tool=shared")
    assert (code, out) == (2, "")
    assert err == "error: 'nope' is neither a checkpoint nor a run folder with one\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["config", TINY, "--bogus"],
            "error: unrecognized argument '--bogus' (overrides are key=value, e.g. "
            "train.steps=5; see atgrpo config --help)\n",
        ),
        (
            ["models", "prepare", "a=1"],
            "error: atgrpo models takes no key=value overrides, got 'a=1'\n",
        ),
        (
            ["config", TINY, "train.stepz=3"],
            "error: unknown config key 'train.stepz' (did you mean 'train.steps'?)\n",
        ),
        (["config"], "error: give a CONFIG file to print, or --describe [SECTION] for every key\n"),
    ],
)
def test_an_error_is_one_line_on_stderr(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = _run(capsys, *argv)
    assert (code, out, err) == (2, "", message)


def _failing(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    """``atgrpo models prepare --tiny`` raises ``exc``."""

    def fail(*_: Any, **__: Any) -> Path:
        raise exc

    monkeypatch.setattr("atgrpo.models.prepare_tiny_model", fail)


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "runs/x/model.safetensors"),
            2,
            "no space left on the device (runs/x/model.safetensors): free some space, or set "
            "run.output_dir to a folder on another disk",
        ),
        (
            PermissionError(errno.EACCES, "Permission denied", "runs/x"),
            2,
            "permission denied (runs/x): make it readable and writable for this user, or set "
            "run.output_dir to a folder of yours",
        ),
        (OSError(errno.EIO, "Input/output error", "runs/x/a"), 2, "input/output error (runs/x/a)"),
        (
            RuntimeError("boom\nsecond line"),
            1,
            "unexpected RuntimeError: boom second line (rerun with --verbose for the traceback, "
            "and please report it)",
        ),
    ],
)
def test_a_failure_is_one_line_and_verbose_shows_the_traceback(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    exc: BaseException,
    code: int,
    message: str,
) -> None:
    _failing(monkeypatch, exc)
    assert _run(capsys, "models", "prepare", "--tiny") == (code, "", f"error: {message}\n")
    got, out, err = _run(capsys, "models", "prepare", "--tiny", "--verbose")
    assert (got, out) == (code, "")
    assert err.startswith("Traceback (most recent call last):") and type(exc).__name__ in err


@pytest.fixture
def tiny_copy(tmp_path: Path) -> Path:
    """A copy of the tiny model's folder, for a test to break."""
    folder = tmp_path / "model"
    shutil.copytree(prepare_tiny_model(), folder)
    return folder


@pytest.mark.parametrize(
    ("breaks", "problem"),
    [
        ("tokenizer", "it has no tokenizer (tokenizer.json or tokenizer_config.json); save the "),
        ("weights", "it has no weights (model.safetensors or pytorch_model.bin); save the model"),
        ("damage", "a weights file is damaged (Error while deserializing header"),
    ],
)
def test_a_broken_model_folder_is_one_line(
    capsys: pytest.CaptureFixture[str], tiny_copy: Path, breaks: str, problem: str
) -> None:
    weights = tiny_copy / "model.safetensors"
    if breaks == "tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (tiny_copy / name).unlink()
    elif breaks == "weights":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[:1000])
    code, out, err = _run(capsys, "eval", TINY, f"model.path={tiny_copy}", "--num-tasks", "1")
    assert (code, out) == (2, "")
    assert err.startswith(f"error: cannot load the model in {tiny_copy}: {problem}")
    assert err.count("\n") == 1


def test_eval_takes_a_swapped_routing_after_the_checkpoint_and_refuses_a_damaged_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [LORA, f"run.output_dir={tmp_path}", "run.name=lora", "train.steps=1", *FAST]
    assert main(["train", *args]) == 0
    run = tmp_path / "lora"
    swap = ["routing.tool=planner", "routing.planner=tool"]
    code, out, err = _run(
        capsys, "eval", *args, "--checkpoint", str(run), "--num-tasks", "1", *swap
    )
    assert code == 0 and "(tool -> planner, planner -> tool)" in out
    checkpoint = run / "checkpoints" / "step-000001"
    assert json.loads((checkpoint / "eval-test.json").read_text())["num_tasks"] == 1
    adapter = checkpoint / "policy-tool" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:-10])
    code, out, err = _run(capsys, "eval", *args, "--checkpoint", str(run))
    assert (code, out) == (2, "")
    assert err.startswith(f"error: checkpoint {checkpoint} is damaged (") and err.count("\n") == 1
    assert "policy-tool/adapter_model.safetensors" in err
    assert err.endswith(
        "): evaluate another one (<run>/checkpoints/step-N) or train the run again\n"
    )


def test_describe_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "config", "--describe") == (0, describe(), "")
    code, out, _ = _run(capsys, "config", "--describe", "env.sudoku")
    assert code == 0 and out.startswith("### env.name: sudoku\n") and "`env.blanks`" in out
    code, _, err = _run(capsys, "config", "--describe", "rolout")
    assert code == 2 and err.startswith("error: --describe 'rolout': no such section; sections:")


def test_the_committed_config_reference_is_current() -> None:
    committed = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == describe(), "docs/config.md is stale: .venv/bin/atgrpo config --describe"


def test_train_prints_held_out_success_with_intervals_and_the_paired_gain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evals = ["eval.before_training=true", "eval.after_training=true", "eval.num_tasks=3"]
    args = [TINY, f"run.output_dir={tmp_path}", "train.steps=1", *FAST, *evals]
    code, out, _ = _run(capsys, "train", *args)
    assert code == 0
    lines = [x for x in out.splitlines() if x.startswith(("held-out success", "gain"))]
    assert len(lines) == 3, out
    for line in lines[:2]:  # "success 33.3% [6.1, 79.2] on 3 test tasks"
        assert re.search(r"success \d+\.\d% \[\d+\.\d, \d+\.\d\] on 3 test tasks", line), line
    assert re.match(r"gain: [+-]\d+\.\d points \[[+-]\d+\.\d, [+-]\d+\.\d\] \(95 %", lines[2])


def test_resume_of_a_run_that_does_not_exist_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [TINY, f"run.output_dir={tmp_path}", "run.name=typo", "--resume"]
    code, _, err = _run(capsys, "train", *args)
    assert code == 2 and "no run folder" in err and "drop --resume" in err
    assert not (tmp_path / "typo").exists()  # nothing made, nothing trained


def test_zero_steps_name_no_metrics_file_and_a_missing_config_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "train", TINY, f"run.output_dir={tmp_path}", "train.steps=0")
    assert code == 0 and "metrics:" not in out
    assert "\ndecode: " in out  # the header's second line
    with pytest.raises(SystemExit):
        main(["train"])
    assert "required: config\n" in capsys.readouterr().err  # not "config, overrides"


def test_the_header_names_the_decode_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The header's decode line: the engine, the device, rollout.cpu_kernels and the precision,
    and on CPU whether atgrpo's AVX-512 kernels run (as sampled tokens depend on it)."""
    import torch

    from atgrpo import policies
    from atgrpo.config import load_config
    from atgrpo.generation import cpu

    def path(*overrides: str) -> str:
        return policies.decode_path(load_config(TINY, ["model.precision=fp32", *overrides]))

    monkeypatch.setattr(policies, "default_device", lambda: torch.device("cpu"))
    assert path("rollout.cpu_kernels=off") == "torch (rollout.cpu_kernels: off)"
    monkeypatch.setattr(cpu.kernels, "cpu_supports", lambda: False)
    assert path() == "torch (this CPU has no AVX-512)"
    monkeypatch.setattr(cpu.kernels, "cpu_supports", lambda: True)
    monkeypatch.setattr(cpu.kernels, "extension", lambda: None)  # the build failed
    assert path() == "torch (atgrpo's AVX-512 kernels did not build)"
    monkeypatch.setattr(cpu.kernels, "extension", lambda: object())
    assert path() == "atgrpo AVX-512 kernels"
    bf16 = path("model.precision=bf16_autocast")
    assert bf16 == "torch under bfloat16 autocast (atgrpo's kernels are float32)"
    assert path("rollout.engine=vllm") == "vLLM"
    monkeypatch.setattr(policies, "default_device", lambda: torch.device("cuda"))
    assert path() == "transformers on cuda"
    assert path("rollout.engine=auto", "backend.kind=ray").startswith("chosen on each Ray worker")


def test_ctrl_c_names_the_step_to_resume_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from atgrpo.training import loop

    args = [TINY, f"run.output_dir={tmp_path}", *FAST, "train.steps=1"]
    assert _run(capsys, "train", *args)[0] == 0  # a checkpoint at step 1

    def interrupt(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_train_step", interrupt)
    code, _, err = _run(capsys, "train", *args[:-1], "train.steps=3", "--resume")
    assert code == 130 and "resume from step 1 (" in err and "--resume" in err


def test_write_eval_json_takes_a_string_path(tmp_path: Path) -> None:
    from atgrpo.training.evaluation import EvalReport, write_eval_json

    report = EvalReport("test", 1, 1.0, 1.0, {}, {}, 1, {})
    out = write_eval_json(report, str(tmp_path / "e.json"))
    assert out == tmp_path / "e.json" and out.is_file()
