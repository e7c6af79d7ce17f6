"""The ``atgrpo`` command line: a thin layer over the library.

atgrpo train CONFIG [key=value ...] [--resume | --resume-from STEP] [--force]
atgrpo eval CONFIG [--checkpoint DIR] [--split test] [--num-tasks N] [--swap A,B] [--force]
            [--opponent random|rule|base|RUN] [key=value ...]
atgrpo compare FILE [--train | --status] [--output-dir DIR] [--num-tasks N]   the methods table
atgrpo models prepare [--force]
atgrpo config CONFIG [key=value ...]        print the resolved config
atgrpo config --describe [SECTION]          every key: type, default, meaning (docs/config.md)
atgrpo report RUN [RUN ...] [--out PATH]     one offline report.html: curves and rollouts
atgrpo check-env CONFIG [key=value ...] [--seeds N]   the config's env against the env rules
atgrpo estimate CONFIG [key=value ...] [--gpus N] [--gpu-memory 80GiB]   memory per device

key=value overrides may stand anywhere on the line. An expected failure (a config mistake, a
missing or damaged file, a full disk, a model folder without a tokenizer) is one line on stderr
that names the problem and the fix; so is an exception of the user's env or reward function,
naming the env class, its method and the file:line that raised (exit 1). ``--verbose``
(anywhere on the line) shows the traceback instead, and third-party warnings and progress bars.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from atgrpo.training.evaluation import EvalReport

from atgrpo import __version__
from atgrpo.config import ConfigError, RolloutEngine, dump_config, load_config
from atgrpo.distributed.cluster import WorkerLostError
from atgrpo.envs.base import EnvError
from atgrpo.experiments.intervals import report_gain, report_interval

console = Console(highlight=False, soft_wrap=True)

# Failures whose message is ours: one line that already names the problem and the fix. Named by
# module, so the CLI imports none of them (`atgrpo --help` loads no torch): an exception of one
# of these types exists only where its module was imported.
EXPECTED_ERRORS = {
    "atgrpo.config": "ConfigError",
    "atgrpo.models": "ModelError",
    "atgrpo.data.base": "DatasetError",
    "atgrpo.sandbox.records": "SandboxSetupError",
    "atgrpo.checkpoint.steps": "CheckpointError",
    "atgrpo.experiments.runs": "RunFailedError",
    "atgrpo.prompts": "PromptTooLongError",
    "atgrpo.distributed.cluster": "WorkerLostError",
}


def expected_errors() -> tuple[type[BaseException], ...]:
    """The :data:`EXPECTED_ERRORS` types of the modules this process has imported."""
    return tuple(
        getattr(sys.modules[module], name)
        for module, name in EXPECTED_ERRORS.items()
        if module in sys.modules
    )


# Libraries whose warnings --verbose alone shows (ours always show, as one line).
_CHATTY = r"(transformers|torch|peft|huggingface_hub|accelerate|safetensors|tokenizers)(\.|$)"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")


def _quiet_libraries(verbose: bool = False) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
    # Our own warnings (e.g. the sandbox's) as one line, without the source line.
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"
    if verbose:
        return  # the libraries' own warnings, logs and progress bars
    # transformers and tokenizers are chatty on stderr; keep the terminal for our lines. Set
    # through the environment they read when first imported, so the CLI imports none of them.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars too
    os.environ.setdefault("TQDM_DISABLE", "1")  # e.g. the GGUF conversion's progress bar
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=_CHATTY)
    if "transformers" in sys.modules:  # imported already (atgrpo as a library): too late for env
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def _print_eval(title: str, report: object) -> None:
    from atgrpo.training.evaluation import EvalReport

    assert isinstance(report, EvalReport)
    valid = "  ".join(f"{a} {v:.2f}" for a, v in report.valid_rate.items())
    n = report.samples_per_task
    sampled = "".join(f", pass@{k} {v:.1%}" for k, v in report.pass_at.items())
    interval = ""
    if report.tasks:  # the 95 % interval over the held-out tasks (Wilson)
        found = report_interval(report.tasks)
        interval = f" [{100 * found.low:.1f}, {100 * found.high:.1f}]"
    console.print(
        f"[bold]{escape(title)}[/]: success {report.success_rate:.1%}{interval}"
        + (f" (avg@{n}{sampled})" if n > 1 else "")
        + f" on {report.num_tasks} {report.split} tasks  (team return "
        f"{report.mean_team_return:+.3f}; valid-format rate {valid})"
    )
    if report.note:  # fewer distinct tasks than asked for
        console.print(f"[yellow]{escape(report.note)}[/]")


def _print_gain(before: EvalReport, after: EvalReport) -> None:
    gain = report_gain(after.tasks, before.tasks)
    if gain is None:
        return
    console.print(
        f"[bold]gain[/]: {100 * gain.mean:+.1f} points [{100 * gain.low:+.1f}, "
        f"{100 * gain.high:+.1f}] (95 % interval, paired bootstrap over the same "
        f"{len(after.tasks)} tasks)"
    )


def cmd_train(args: argparse.Namespace) -> int:
    import signal

    from atgrpo.checkpoint import CheckpointError
    from atgrpo.training.loop import train
    from atgrpo.training.run_dir import Interrupted, TrainError

    cfg = load_config(args.config, args.overrides)
    if args.force and not (args.resume or args.resume_from is not None):
        print("error: --force applies to --resume and --resume-from only", file=sys.stderr)
        return 2
    console.print(f"[bold]atgrpo train[/] {escape(_train_header(cfg))}")
    try:  # outside the bar, whose console would take these lines to stdout
        with _step_bar(cfg.train.steps) as on_step:
            result = train(
                cfg,
                resume=args.resume,
                on_step=on_step,
                resume_from=args.resume_from,
                force=args.force,
            )
    except Interrupted as exc:  # SIGTERM: stopped after a step, its checkpoint written
        print(f"interrupted: {exc}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:  # Ctrl-C: wherever it fell, the newest committed checkpoint stands
        print(f"interrupted: {_resume_hint(cfg, args.config)}", file=sys.stderr)
        return 128 + signal.SIGINT
    except (TrainError, CheckpointError) as exc:  # the folder is in use; nothing to resume
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WorkerLostError as exc:  # a Ray worker died: the newest committed checkpoint stands
        line = f"{_lost_worker(exc)}; the run stopped: {_resume_hint(cfg, args.config)}"
        print(f"error: {line}", file=sys.stderr)
        return 1
    _print_train_result(result)
    return 0


def _lost_worker(exc: WorkerLostError) -> str:
    """Which worker was lost, and in which step's phase: the step is the loop's step function's
    own ``step``, found in the traceback."""
    from atgrpo.training.loop import _train_step

    step = next(
        (
            frame.f_locals["step"]
            for frame, _ in traceback.walk_tb(exc.__traceback__)
            if frame.f_code is _train_step.__code__
        ),
        None,
    )
    during = f"step {step}'s {exc.call}" if step is not None else f"the {exc.call}"
    return f"{exc.worker} was lost during {during} ({exc.reason})"


def _resume_hint(cfg: Any, config: str) -> str:
    """Where a stopped run resumes: its newest committed checkpoint's step, or step 0."""
    from atgrpo import checkpoint as ckpt

    latest = ckpt.latest_checkpoint(cfg.run_dir)
    if latest is None:
        return f"no checkpoint yet in {cfg.run_dir}: --resume starts again from step 0"
    step = ckpt.checkpoint_step(latest)
    return f"resume from step {step} ({latest}) with: atgrpo train {config} ... --resume"


def _train_header(cfg: Any) -> str:
    """Two lines: the run, its env and workflow, policies, model(s), budget and output folder;
    then the path the rollout's decoding takes (sampled tokens depend on it)."""
    from atgrpo.envs import make_env
    from atgrpo.policies import decode_path, describe_regime, resolve_routing

    policy_of = resolve_routing(cfg, make_env(cfg.env).possible_agents)
    workflow = getattr(cfg.env, "workflow", None)
    env = cfg.env.name + (f" ({getattr(workflow, 'value', workflow)})" if workflow else "")
    models = ", ".join(dict.fromkeys(cfg.policy_model(p) for p in cfg.policies))
    return (
        f"{cfg.run.name}: env {env}, {describe_regime(cfg, policy_of)}, model {models}, "
        f"{cfg.train.steps} steps x {cfg.rollout.num_tasks} tasks x K={cfg.rollout.num_generations}"
        f" ({cfg.rollout.sampling.value}, grouping {cfg.algo.grouping.value}) -> {cfg.run_dir}"
        f"\ndecode: {decode_path(cfg)}"
    )


@contextlib.contextmanager
def _step_bar(steps: int) -> Iterator[Callable[[int, dict[str, float]], None]]:
    """A transient progress bar over the steps; yields the ``on_step`` that moves it."""
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as progress:
        bar = progress.add_task("training", total=steps)

        def on_step(step: int, metrics: dict[str, float]) -> None:
            # The step's line is the console logger's (run.loggers); here only the bar moves.
            rewards = [
                v for k, v in metrics.items() if k.startswith("reward/") and k.endswith("/mean")
            ]
            mean = sum(rewards) / max(1, len(rewards))
            success = metrics.get("rollout/success", 0.0)
            progress.update(
                bar, completed=step, description=f"reward {mean:+.2f} success {success:.2f}"
            )

        yield on_step


def _print_train_result(result: Any) -> None:
    if result.eval_before is not None:
        _print_eval("held-out success before training", result.eval_before)
    if result.eval_after is not None:
        _print_eval("held-out success after training ", result.eval_after)
    if result.eval_before is not None and result.eval_after is not None:
        _print_gain(result.eval_before, result.eval_after)
    if result.checkpoint is not None:
        console.print(f"checkpoint: {result.checkpoint}")
    if (metrics := result.run_dir / "metrics.jsonl").is_file():  # train.steps=0 writes none
        console.print(f"metrics: {metrics}")


def cmd_eval(args: argparse.Namespace) -> int:
    from atgrpo.api import load_checkpoint
    from atgrpo.envs import Split, make_env
    from atgrpo.policies import swapped_routing
    from atgrpo.training.evaluation import (
        check_checkpoint_config,
        eval_json_path,
        eval_json_target,
        measured,
        write_eval_json,
    )
    from atgrpo.training.loop import seed_everything
    from atgrpo.training.runtime import build_runtime

    overrides = [*args.overrides]
    if args.num_tasks is not None:  # in the config, so that eval-<split>.json records it
        overrides.append(f"eval.num_tasks={args.num_tasks}")
    if args.ablate:
        overrides.append(f"eval.ablate=[{','.join(args.ablate)}]")
    cfg = load_config(args.config, overrides)
    # a swapped-roles or ablated evaluation never overwrites the plain one
    suffix = "".join(f"-ablate-{a}" for a in cfg.eval.ablate)
    if args.swap:
        pair = tuple(a.strip() for a in args.swap.split(","))
        if len(pair) != 2:
            raise ConfigError(f"--swap {args.swap!r}: give two agents, e.g. --swap tool,planner")
        agents = make_env(cfg.env).possible_agents
        swap = swapped_routing(cfg, agents, (pair[0], pair[1]))
        cfg = load_config(args.config, [*overrides, *swap])
        suffix += f"-swap-{pair[0]}-{pair[1]}"
    checkpoint = load_checkpoint(args.checkpoint) if args.checkpoint else None  # verified
    if checkpoint is not None:
        check_checkpoint_config(cfg, checkpoint, args.force)
    seed_everything(cfg.run.seed)
    if args.opponent:
        return _eval_matches(cfg, checkpoint, args)
    rt = build_runtime(cfg, checkpoint, "evaluation")  # in the precision the run trained in
    try:
        report = rt.evaluate(Split(args.split), cfg.eval.num_tasks)
        routing = ", ".join(f"{a} -> {p}" for a, p in rt.policy_of.items())
    finally:
        rt.close()
    _print_eval(f"{checkpoint or cfg.model.path} ({routing})", report)
    path = eval_json_path(report.split, checkpoint, cfg.run_dir, suffix)
    out = write_eval_json(report, eval_json_target(path, cfg), measured(cfg, checkpoint))
    if out != path:
        console.print(f"{escape(path.name)} holds an evaluation of another config: kept")
    console.print(f"per-task results: {escape(str(out))}")
    return 0


def _eval_matches(cfg: Any, checkpoint: Path | None, args: argparse.Namespace) -> int:
    """``atgrpo eval --opponent``: each policy in each seat of a game against the opponent."""
    from atgrpo.envs import Split
    from atgrpo.experiments.matches import (
        SeatResult,
        build_opponent,
        seats_report,
        write_matches_json,
    )
    from atgrpo.training.evaluation import eval_json_path, measured
    from atgrpo.training.runtime import build_runtime

    opponent = build_opponent(cfg, args.opponent)
    rt = build_runtime(cfg, checkpoint, "evaluation")
    split = Split(args.split)
    title = f"{checkpoint or cfg.model.path} vs {args.opponent}"
    console.print(f"[bold]{escape(title)}[/] ({cfg.eval.num_tasks} {split.value} games a seat)")

    def show(r: SeatResult) -> None:
        low, high = r.interval
        console.print(
            f"  {escape(r.policy)} as {escape(r.seat)}: win {r.win_rate:.1%} "
            f"[{100 * low:.1f}, {100 * high:.1f}]  ({r.wins} won, {r.draws} drawn, "
            f"{r.losses} lost; {r.invalid_moves} invalid of {r.moves} moves)"
        )

    try:
        results = seats_report(rt, opponent, split, cfg.eval.num_tasks, show)
    finally:
        rt.close()
        if opponent.runtime is not None:
            opponent.runtime.close()
    name = Path(args.opponent).name if args.opponent not in ("random", "rule", "base") else None
    suffix = f"-vs-{name or args.opponent}"
    path = eval_json_path(split.value, checkpoint, cfg.run_dir, suffix)
    write_matches_json(results, path, args.opponent, split, measured(cfg, checkpoint))
    console.print(f"per-seat results: {escape(str(path))}")
    return 0


def cmd_check_env(args: argparse.Namespace) -> int:
    from atgrpo.envs import EnvCheckError, check_env, make_env
    from atgrpo.envs.base import env_call

    cfg = load_config(args.config, args.overrides)
    env = make_env(cfg.env)
    seeds = tuple(range(args.seeds))
    try:
        with env_call(env, "reset"):  # an exception of the env's own code names the env
            check_env(env, seeds=seeds, factory=lambda: make_env(cfg.env))
    except EnvCheckError as exc:
        print(f"error: check_env: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    console.print(
        f"check_env: {escape(cfg.env.name)} ({type(env).__name__}) passed on seeds "
        f"0-{args.seeds - 1}"
    )
    packages = getattr(cfg.env, "sandbox_packages", None)
    if packages is not None:
        from atgrpo.sandbox import program_packages

        console.print(
            "sandboxed programs may import: "
            f"{escape(', '.join(program_packages(packages)))} (env.sandbox_packages and what "
            "they require; nothing else of this environment)"
        )
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from atgrpo.experiments.compare import load_comparison

    comparison = load_comparison(args.file)
    if args.num_tasks:
        comparison.eval["num_tasks"] = args.num_tasks
    if args.seeds:
        comparison.seeds = _some_seeds(args.seeds, comparison.seeds)
    if args.output_dir:
        comparison.output_dir = args.output_dir
    if args.train:
        if _train_comparison(comparison):
            console.print(
                "the table waits for the runs other --train processes are training: run "
                "`atgrpo compare FILE` when they end"
            )
            return 0
    elif args.status:
        _print_grid_status(comparison)
        return 0
    return _evaluate_comparison(comparison)


def _some_seeds(given: str, seeds: list[int]) -> list[int]:
    """``--seeds 0,2``: a subset of the file's seeds, in the file's order."""
    try:
        chosen = {int(s) for s in given.split(",")}
    except ValueError:
        raise ConfigError(f"--seeds {given!r}: give seeds as integers, e.g. --seeds 0,1") from None
    if unknown := sorted(chosen - set(seeds)):
        raise ConfigError(f"--seeds {given!r}: {unknown} not among the file's seeds {seeds}")
    return [s for s in seeds if s in chosen]


def _print_grid_status(comparison: Any) -> None:
    from atgrpo.experiments.runs import grid_status, probe_claim

    for st in grid_status(comparison):
        steps = st.spec.cfg.train.steps
        with probe_claim(st.spec) as free:
            busy = "" if free or st.finished else ", training now"
        console.print(
            f"{st.state:<8} {st.step:>4}/{steps}  {escape(st.spec.method.label)} | "
            f"{escape(st.spec.bench.name)} | seed {st.spec.seed}  "
            f"({escape(str(st.spec.run_dir))}{busy})"
        )


def _train_comparison(comparison: Any) -> int:
    """Train the grid's missing runs; how many were left to other --train processes."""
    from atgrpo.experiments.runs import RunStatus, train_grid

    busy = 0

    def on_status(st: RunStatus, what: str) -> None:
        nonlocal busy
        spec = st.spec
        name = f"{escape(spec.method.label)} | {escape(spec.bench.name)} | seed {spec.seed}"
        if what == "busy":
            busy += 1
            console.print(f"skipping {name}: another --train process is training it")
        elif what == "start":
            how = "resuming from step " + str(st.step) if st.state == "partial" else "training"
            console.print(f"{how}: {name} -> {escape(str(spec.run_dir))}")
        else:
            console.print(f"  trained {name} in {what}")

    def on_eval(spec: Any, row: str, report: Any) -> None:
        console.print(
            f"  evaluated {escape(row)} | seed {spec.seed}: success {report.success_rate:.1%} "
            f"on {report.num_tasks} tasks (kept in the records)"
        )

    statuses = train_grid(comparison, on_status, on_eval)
    done = sum(st.finished for st in statuses)
    console.print(f"runs: {len(statuses)} planned, {done} were already finished")
    return busy


def _evaluate_comparison(comparison: Any) -> int:
    from atgrpo.experiments.compare import run_comparison, write_curves
    from atgrpo.experiments.tables import (
        DIFFERENCES_TITLE,
        TableCell,
        difference_rows,
        table_rows,
        write_tables,
    )

    out = Path(comparison.output_dir)
    total = len(comparison.methods) * len(comparison.benchmarks)
    done = 0

    def on_cell(cell: TableCell) -> None:
        nonlocal done
        done += 1
        seeds = f" (mean of {len(cell.seeds)} seeds)" if len(cell.seeds) > 1 else ""
        console.print(
            f"[{done}/{total}] {escape(cell.benchmark)} | {escape(cell.method)}: "
            f"success {cell.success_rate:.1%} on {cell.report.num_tasks} tasks{seeds}"
        )
        if cell.report.note:
            console.print(f"  [yellow]{escape(cell.report.note)}[/]")

    cells = run_comparison(comparison, on_cell=on_cell)
    split = comparison.split.value
    title = f"success % [95 % interval] on {split} tasks; difference to the first row"
    console.print(_rich_table(title, *table_rows(cells), left=1))
    if comparison.differences:
        rows = difference_rows(cells, comparison.differences)
        console.print(_rich_table(DIFFERENCES_TITLE, *rows, left=2))
    md, csv_path = write_tables(cells, out, comparison.differences)
    console.print(f"tables: {escape(str(md))}  {escape(str(csv_path))}")
    if (curves := write_curves(comparison)) is not None:
        console.print(f"learning curves: {escape(str(curves))}")
    return 0


def _rich_table(title: str, header: list[str], rows: list[list[str]], left: int) -> Any:
    """A console table; its first ``left`` columns (the row names) aligned left."""
    from rich.table import Table

    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i < left else "right")
    for row in rows:
        table.add_row(*(escape(x) for x in row))
    return table


def cmd_models(args: argparse.Namespace) -> int:
    from atgrpo import models

    path = models.prepare_tiny_model() if args.tiny else models.prepare_default_model(args.force)
    console.print(f"model ready: {escape(str(path))}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    # Printed as it is: rich markup would eat brackets in values (run.name=a[bold]b).
    if args.describe is not None:
        from atgrpo.config_docs import describe

        if args.config is not None or args.overrides:
            raise ConfigError("--describe takes a SECTION, not a CONFIG or overrides")
        sys.stdout.write(describe(args.describe or None))
        return 0
    if args.config is None:
        raise ConfigError("give a CONFIG file to print, or --describe [SECTION] for every key")
    sys.stdout.write(dump_config(load_config(args.config, args.overrides)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from atgrpo.report import ReportError, write_report

    try:
        out = write_report([Path(r) for r in args.runs], Path(args.out) if args.out else None)
    except ReportError as exc:  # a missing run folder, or one without metrics.jsonl
        print(f"error: {exc}", file=sys.stderr)
        return 2
    console.print(f"report: {escape(str(out))}")
    return 0


def cmd_tool_use(args: argparse.Namespace) -> int:
    from atgrpo.experiments.tool_use import format_tool_use, read_samples, tool_use

    keys = None
    if args.keys:
        pair = [k.strip() for k in args.keys.split(",")]
        if len(pair) != 2 or not all(pair):
            raise ConfigError(
                f"--keys {args.keys!r}: give two info keys, e.g. moves,plan_reaches_goal"
            )
        keys = (pair[0], pair[1])
    for path in args.samples:
        try:
            result = tool_use(read_samples(Path(path)), args.tool, args.actor, keys)
        except ValueError as exc:  # an unreadable file, an unknown agent or info key
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps({"samples": path, **result.summary()}))
        else:
            console.print(escape(f"{path}\n{format_tool_use(result)}"))
    return 0


def cmd_groups(args: argparse.Namespace) -> int:
    from atgrpo.experiments.groups import (
        format_costs,
        format_groups,
        group_rows,
        read_run_metrics,
        step_costs,
    )

    first, last = _step_range(args.steps)
    for run in args.runs:
        try:
            records = read_run_metrics(Path(run))
        except ValueError as exc:  # no metrics.jsonl, or an unreadable one
            print(f"error: {exc}", file=sys.stderr)
            return 2
        rows, costs = group_rows(records, first, last), step_costs(records, first, last)
        if not rows:
            print(f"error: {run}: no groups/ metrics in that step range", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps({"run": run, "groups": [vars(r) for r in rows], "step": costs}))
        else:
            console.print(escape(f"{run}\n{format_groups(rows)}\n{format_costs(costs)}"))
    return 0


def cmd_slim(args: argparse.Namespace) -> int:
    import torch

    from atgrpo.checkpoint import resolve_checkpoint
    from atgrpo.checkpoint.slim import slim_checkpoint

    for path in args.paths:
        folder = resolve_checkpoint(path)
        freed = slim_checkpoint(folder, getattr(torch, args.dtype), unfinished=args.unfinished)
        print(f"{folder}: weights alone ({args.dtype}), {freed / 2**30:.2f} GiB freed")
    return 0


def _step_range(text: str | None) -> tuple[int | None, int | None]:
    if text is None:
        return None, None
    ends = [e.strip() for e in text.split(":")]
    if len(ends) != 2 or not all(e.lstrip("-").isdigit() for e in ends if e):
        raise ConfigError(f"--steps {text!r}: give FIRST:LAST, e.g. 1:30 or 31: (ends optional)")
    first, last = (int(e) if e else None for e in ends)
    return first, last


_Commands = argparse._SubParsersAction  # the subcommands of build_parser
_OVERRIDES_HELP = "dotted key=value overrides, e.g. train.steps=5 (anywhere on the line)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atgrpo", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"atgrpo {__version__}")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="on a failure, show the traceback instead of one line; show third-party warnings "
        "and progress bars (may also follow the subcommand)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_eval(sub)
    _add_compare(sub)
    _add_models(sub)
    _add_config(sub)
    _add_report(sub)
    _add_check_env(sub)
    _add_tool_use(sub)
    _add_groups(sub)
    _add_slim(sub)
    _add_estimate(sub)
    return parser


def _add_train(sub: _Commands) -> None:
    p = sub.add_parser("train", help="train a team of agents with AT-GRPO")
    p.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    p.add_argument("overrides", nargs="*", default=[], help=_OVERRIDES_HELP)
    p.add_argument(
        "--resume", action="store_true", help="continue from the run's newest intact checkpoint"
    )
    p.add_argument(
        "--resume-from",
        type=int,
        metavar="STEP",
        help="continue from the checkpoint of step STEP; later checkpoints and log lines are "
        "set aside",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="resume even when the model, policies, routing or env changed in the config",
    )
    p.set_defaults(func=cmd_train)


def _add_eval(sub: _Commands) -> None:
    p = sub.add_parser("eval", help="evaluate a config's model or a checkpoint on held-out tasks")
    p.add_argument("config", help="YAML config, e.g. configs/demo.yaml or <run>/config.yaml")
    p.add_argument("overrides", nargs="*", default=[], help=_OVERRIDES_HELP)
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a checkpoint folder or a run folder (uses its latest); default: the config's "
        "untrained models",
    )
    p.add_argument(
        "--split",
        default="test",
        choices=["validation", "test"],
        help="the held-out split to score (default: test)",
    )
    p.add_argument(
        "--num-tasks",
        type=int,
        default=None,
        metavar="N",
        help="distinct held-out tasks to score (default: eval.num_tasks)",
    )
    p.add_argument(
        "--swap",
        metavar="A,B",
        help="exchange the policies of agents A and B (e.g. tool,planner: swapped-roles ablation)",
    )
    p.add_argument(
        "--ablate",
        action="append",
        metavar="AGENT",
        help="give the env an empty answer for AGENT at every turn, so the others act without it "
        "(how much the team relies on it); repeat for several; writes eval-<split>-ablate-AGENT",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="evaluate a checkpoint even when the config names another env, model or policies",
    )
    p.add_argument(
        "--opponent",
        metavar="KIND",
        help="a game (env.name: textarena): play each policy in each seat against random (legal "
        "moves), rule (the game's fixed rule), base (the untrained models) or a run folder; "
        "prints win rates with 95%% intervals (docs/textarena.md)",
    )
    p.set_defaults(func=cmd_eval)


def _add_compare(sub: _Commands) -> None:
    p = sub.add_parser("compare", help="evaluate methods x benchmarks; write table.md / table.csv")
    p.add_argument("file", help="a comparison YAML, e.g. configs/compare/tiny-table.yaml")
    p.add_argument(
        "--output-dir", metavar="DIR", help="where the tables go (default: the file's output_dir)"
    )
    p.add_argument(
        "--num-tasks", type=int, default=None, metavar="N", help="held-out tasks per benchmark"
    )
    p.add_argument(
        "--train",
        action="store_true",
        help="first train (or resume) every run the file's `train: true` methods still need",
    )
    p.add_argument(
        "--status", action="store_true", help="list the training runs and how far each got"
    )
    p.add_argument(
        "--seeds",
        metavar="S,S",
        help="only these of the file's seeds, e.g. 0 for a table of the runs finished so far",
    )
    p.set_defaults(func=cmd_compare)


def _add_models(sub: _Commands) -> None:
    p = sub.add_parser("models", help="prepare the embedded models")
    msub = p.add_subparsers(dest="models_command", required=True)
    q = msub.add_parser("prepare", help="convert the embedded default model into the cache")
    q.add_argument("--force", action="store_true", help="convert again even if cached")
    q.add_argument("--tiny", action="store_true", help="build the tiny random test model instead")
    q.set_defaults(func=cmd_models)


def _add_config(sub: _Commands) -> None:
    p = sub.add_parser(
        "config", help="print a config with defaults and overrides applied, or describe every key"
    )
    p.add_argument("config", nargs="?", help="YAML config, e.g. configs/demo.yaml")
    p.add_argument("overrides", nargs="*", default=[], help=_OVERRIDES_HELP)
    p.add_argument(
        "--describe",
        nargs="?",
        const="",
        metavar="SECTION",
        help="print every key with its type, default and meaning (docs/config.md); SECTION: "
        "run, env, env.math, package.module:ClassName, ...",
    )
    p.set_defaults(func=cmd_config)


def _add_report(sub: _Commands) -> None:
    p = sub.add_parser("report", help="write one self-contained report.html of one or more runs")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders, e.g. runs/demo-...")
    p.add_argument(
        "--out", metavar="PATH", help="where the page goes (default: <first run>/report.html)"
    )
    p.set_defaults(func=cmd_report)


def _add_tool_use(sub: _Commands) -> None:
    p = sub.add_parser(
        "tool-use",
        help="how a tool team used its tool in an evaluation: tool right, actor follows it, ...",
    )
    p.add_argument(
        "samples",
        nargs="+",
        metavar="SAMPLES",
        help="eval-<split>...-samples.jsonl files that atgrpo eval / compare wrote",
    )
    p.add_argument("--tool", default="tool", help="the tool agent (default: tool)")
    p.add_argument("--actor", help="the agent that acts on its output (default: the other one)")
    p.add_argument(
        "--keys",
        metavar="ANSWER,RIGHT",
        help="the info keys of an answer and of its being right (default: those of the "
        "samples' env, Plan-Path, Sokoban or math; docs/cli.md lists them)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per file")
    p.set_defaults(func=cmd_tool_use)


def _add_groups(sub: _Commands) -> None:
    p = sub.add_parser(
        "groups",
        help="a run's advantage groups per agent and turn: count, size, share with tied rewards",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (or their metrics.jsonl)")
    p.add_argument(
        "--steps", metavar="FIRST:LAST", help="only these training steps (either end optional)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    p.set_defaults(func=cmd_groups)


def _add_slim(sub: _Commands) -> None:
    p = sub.add_parser(
        "slim",
        help="reduce finished runs' last checkpoints to their weights (drops optimizer state)",
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="RUN",
        help="run folders (their latest checkpoint) or "
        "checkpoint folders, e.g. runs/demo-.../checkpoints/step-000030",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the weights' dtype (default: float32, the trained weights as they are, so an "
        "evaluation gives the same figures; bfloat16 halves them, as checkpoint.final: weights "
        "under bf16 autocast)",
    )
    p.add_argument(
        "--unfinished",
        action="store_true",
        help="also slim a checkpoint short of its run's last step (the run cannot resume then)",
    )
    p.set_defaults(func=cmd_slim)


def _add_check_env(sub: _Commands) -> None:
    p = sub.add_parser(
        "check-env", help="check a config's env against the env rules (atgrpo.check_env)"
    )
    p.add_argument("config", help="YAML config naming the env, e.g. examples/guess.yaml")
    p.add_argument("overrides", nargs="*", default=[], help=_OVERRIDES_HELP)
    p.add_argument(
        "--seeds", type=int, default=3, metavar="N", help="check seeds 0..N-1 (default: 3)"
    )
    p.set_defaults(func=cmd_check_env)


def cmd_estimate(args: argparse.Namespace) -> int:
    from atgrpo.training import estimate as est

    memory = est.parse_size(args.gpu_memory) if args.gpu_memory is not None else None
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: give the number of GPUs there are, 1 or more")
    cfg = load_config(args.config, args.overrides)
    found = est.estimate(cfg, memory)
    unit = "GiB (2^30 bytes)"
    against = f"{found.memory / est.GIB:.1f} GiB ({found.memory_source})"
    print(
        f"atgrpo estimate {args.config}: memory per device and phase in {unit}, against {against}"
    )
    for line in est.table(found):
        print(line)
    if cfg.rollout.engine is RolloutEngine.AUTO:
        chosen = est.engine(cfg, found.on_gpu, shard=False)
        why = "installed here" if chosen is RolloutEngine.VLLM else "no vLLM or no GPU here"
        print(f"rollout.engine auto: {chosen.value} ({why}; a sharded policy samples with hf)")
    kept = found.disk_per_checkpoint * found.checkpoints_kept
    print(
        f"disk: {found.disk_per_checkpoint / est.GIB:.1f} GiB per checkpoint, "
        f"{kept / est.GIB:.1f} GiB for the {found.checkpoints_kept} kept (checkpoint.keep)"
    )
    have = args.gpus if args.gpus is not None else found.gpus_needed
    enough = not found.on_gpu or found.gpus_needed <= have
    if found.on_gpu:
        print(f"GPUs: the config takes {found.gpus_needed}, there are {have}")
    if found.fits and enough:
        print("fits: every device's peak is within its memory")
        return 0
    if not enough:
        print("does not fit: fewer backend.policies.<id>.num_workers, or more GPUs (--gpus)")
    if found.fits:
        return 1
    worst = max(found.device_totals().items(), key=lambda kv: kv[1])
    (device, phase), peak = worst
    print(f"does not fit: {device} needs {peak / est.GIB:.2f} GiB in the {phase} phase; try:")
    options = est.fixes(
        cfg, lambda extra: load_config(args.config, [*args.overrides, *extra]), memory
    )
    for what, after in options:
        print(f"  {what}   (peak {after:.2f} GiB)")
    if not options:
        print("  no single change fits: combine them, or take a device with more memory")
    return 1


def _add_estimate(sub: _Commands) -> None:
    p = sub.add_parser(
        "estimate",
        help="the memory a config needs per device and phase, before anything loads",
    )
    p.add_argument("config", help="YAML config, e.g. configs/gpu/qwen3-1.7b-math-mas.yaml")
    p.add_argument("overrides", nargs="*", default=[], help=_OVERRIDES_HELP)
    p.add_argument(
        "--gpus", type=int, default=None, metavar="N", help="GPUs there are (default: as needed)"
    )
    p.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="one GPU's memory, e.g. 80GiB or 80GB (default: this machine's device: a GPU's "
        "memory, else the RAM)",
    )
    p.set_defaults(func=cmd_estimate)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    verbose = args.verbose or "--verbose" in extra
    _quiet_libraries(verbose)
    if problem := _take_overrides(args, [t for t in extra if t != "--verbose"]):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted: resume with --resume from the last checkpoint", file=sys.stderr)
        return 130
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        else:
            print(f"error: {describe_failure(exc)}", file=sys.stderr)
        return 2 if _expected(exc) else 1


def _take_overrides(args: argparse.Namespace, extra: list[str]) -> str | None:
    """Append the ``key=value`` tokens argparse left over (an override after an option) to the
    command's overrides; the problem with any other leftover, else None."""
    overrides = [t for t in extra if "=" in t and not t.startswith("-")]
    if other := [t for t in extra if t not in overrides]:
        return (
            f"unrecognized argument {other[0]!r} (overrides are key=value, e.g. train.steps=5; "
            f"see atgrpo {args.command} --help)"
        )
    if overrides and not hasattr(args, "overrides"):
        return f"atgrpo {args.command} takes no key=value overrides, got {overrides[0]!r}"
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return None


def _expected(exc: BaseException) -> bool:
    return isinstance(exc, (*expected_errors(), OSError)) or _model_load_path(exc) is not None


def describe_failure(exc: BaseException) -> str:
    """``exc`` as one line that names the problem and, where it can, the fix."""
    if isinstance(exc, expected_errors()):
        return _one_line(str(exc))
    if (path := _model_load_path(exc)) is not None:
        return _model_failure(path, exc)
    if isinstance(exc, OSError):
        return _os_failure(exc)
    if (env_exc := _env_error(exc)) is not None:  # the user's env (or reward function) raised
        return f"{_one_line(str(env_exc))}; run with --verbose for the traceback"
    return (
        f"unexpected {type(exc).__name__}: {_one_line(str(exc))} (rerun with --verbose for the "
        "traceback, and please report it)"
    )


def _env_error(exc: BaseException) -> EnvError | None:
    """The :class:`EnvError` ``exc`` is (or, from a Ray env worker, carries as ``cause``)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, EnvError):
        return cause
    return exc if isinstance(exc, EnvError) else None


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _os_failure(exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"no space left on the device{where}: free some space, or set run.output_dir to a "
            "folder on another disk"
        )
    if isinstance(exc, PermissionError):
        return (
            f"permission denied{where}: make it readable and writable for this user, or set "
            "run.output_dir to a folder of yours"
        )
    if exc.errno == errno.EROFS:
        return f"read-only file system{where}: set run.output_dir to a writable folder"
    if exc.errno is None or not exc.strerror:
        return _one_line(str(exc))  # a message of ours, e.g. "... is neither a checkpoint ..."
    return f"{exc.strerror.lower()}{where}"


def _model_load_path(exc: BaseException) -> str | None:
    """The model path :func:`atgrpo.models.load_model` was loading when ``exc`` was raised in
    it (by transformers, safetensors, ...), else None."""
    models = sys.modules.get("atgrpo.models")  # not imported: no model was loading
    if models is None:
        return None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        if frame.f_code is models.load_model.__code__:
            return str(frame.f_locals.get("source", frame.f_locals.get("path")))
    return None


def _model_failure(path: str, exc: BaseException) -> str:
    folder = Path(path)
    fix = "point model.path (or the policy's model) at a folder saved with save_pretrained"
    if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        problem = "it has no tokenizer (tokenizer.json or tokenizer_config.json)"
        fix = "save the tokenizer into it (tokenizer.save_pretrained) or " + fix
    elif folder.is_dir() and not any(any(folder.glob(g)) for g in _WEIGHT_GLOBS):
        problem = "it has no weights (model.safetensors or pytorch_model.bin)"
        fix = "save the model into it (model.save_pretrained) or " + fix
    elif type(exc).__name__ == "SafetensorError":
        problem = f"a weights file is damaged ({_one_line(str(exc))})"
        fix = "copy the model again, or for a checkpoint evaluate another one"
    else:
        problem = f"{type(exc).__name__}: {_one_line(str(exc))}"
    return f"cannot load the model in {path}: {problem}; {fix}"


if __name__ == "__main__":
    sys.exit(main())
