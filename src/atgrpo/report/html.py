"""The page: one self-contained HTML document (images as data URIs, inline CSS, JS and JSON).

Nothing in it refers outside the file, so it opens offline, from a mail attachment or a copied
run folder. Every text from a run is escaped; the viewer's JSON escapes ``<`` so that no sample
text can close its ``<script>`` element.
"""

from __future__ import annotations

import json
from datetime import datetime
from html import escape
from typing import Any

from atgrpo.report.assets import CSS, ERRORS_JS, VIEWER_JS
from atgrpo.report.data import Run
from atgrpo.report.plots import Figures, Plot, run_color

DASH = "\u2013"


def build_page(runs: list[Run], figures: Figures, payload: dict[str, Any]) -> str:
    learning = [p for p in figures.plots if p.section == "learning"]
    signal = [p for p in figures.plots if p.section != "learning"]
    names = ", ".join(r.name for r in runs)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>atgrpo report: {escape(names)}</title>",
        f"<style>{CSS}</style>",
        f"<script>{ERRORS_JS}</script>",
        '</head><body data-ready="0" data-errors="">',
        _header(runs),
        "<main>",
        _summary(runs),
        _notes(runs, payload),
        _curves("curves", "Learning", learning, []),
        _viewer(payload),
        _curves("signal", "Training signal and cost", signal, figures.zero),
        _evals(runs),
        _configs(runs),
        "</main>",
        json_script("rollouts", payload),
        f"<script>{VIEWER_JS}</script>",
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p) + "\n"


def json_script(element_id: str, data: Any) -> str:
    """``data`` as an inert JSON block; ``<`` escaped, so ``</script>`` in a text is harmless."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False).replace("<", "\\u003c")
    return f'<script type="application/json" id="{escape(element_id)}">{text}</script>'


def _header(runs: list[Run]) -> str:
    when = datetime.now().strftime("%Y-%m-%d %H:%M")
    title = "run report" if len(runs) == 1 else f"{len(runs)} runs compared"
    links = "".join(
        f'<a href="#{a}">{t}</a>'
        for a, t in [
            ("summary", "summary"),
            ("curves", "learning"),
            ("viewer", "rollouts"),
            ("signal", "training signal"),
            ("config", "config"),
        ]
    )
    return (
        f'<header class="top"><h1>atgrpo {title}</h1>'
        f'<span class="sub">{escape(", ".join(r.name for r in runs))} \u00b7 written {when}</span>'
        f"<nav>{links}</nav></header>"
    )


def _summary(runs: list[Run]) -> str:
    head = [
        "run",
        "env",
        "model / policies",
        "agents",
        "steps",
        "batch",
        "alpha",
        "test success before \u2192 after",
        "train success (last 10 steps)",
        "cut at max_new_tokens",
        "wall time",
    ]
    rows = [_summary_row(i, run) for i, run in enumerate(runs)]
    return (
        '<h2 id="summary">Summary</h2><table class="summary"><tr>'
        + "".join(f"<th>{escape(h)}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )


def _summary_row(i: int, run: Run) -> str:
    policies = run.cfg("policies", {}) or {}
    model = str(run.cfg("model.path", DASH))
    if isinstance(policies, dict) and len(policies) > 1:
        model += f" ({len(policies)} policies: {', '.join(map(str, policies))})"
    train = run.train_steps
    cells = [
        f'<span class="swatch" style="background:{run_color(i)}"></span>{escape(run.name)}',
        escape(f"{run.cfg('env.name', DASH)} ({run.cfg('env.workflow', DASH)})"),
        escape(model),
        escape(", ".join(run.agents) or DASH),
        escape(f"{train[-1] if train else 0} / {run.cfg('train.steps', DASH)}"),
        escape(
            f"{run.cfg('rollout.num_tasks', DASH)} tasks \u00d7 "
            f"K={run.cfg('rollout.num_generations', DASH)} ({run.cfg('rollout.sampling', DASH)})"
        ),
        escape(str(run.cfg("algo.alpha", DASH))),
        escape(_before_after(run)),
        escape(_recent_mean(run, "rollout/success")),
        escape(cut_rates(run)),
        escape(_duration(sum(run.series("perf/step_s")[1]))),
    ]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _before_after(run: Run) -> str:
    """Test success before and after training: the run's own test/ records (eval.before_training,
    eval.after_training), else what ``atgrpo eval`` wrote: ``eval-test.json`` of the run folder
    (the untrained model) and of the newest checkpoint that has one."""
    steps, values = run.series("test/success")
    before = f"{values[0]:.1%}" if steps and steps[0] == 0 else None
    after = f"{values[-1]:.1%}" if steps and steps[-1] > 0 else None
    tests = [e for e in run.evals if e.split == "test" and "success_rate" in e.values]
    evaluated = []
    if before is None and (untrained := [e for e in tests if e.step is None]):
        before = f"{untrained[0].values['success_rate']:.1%}"
        evaluated.append("untrained")
    if after is None and (trained := [e for e in tests if e.step is not None]):
        newest = max(trained, key=lambda e: e.step or 0)
        after = f"{newest.values['success_rate']:.1%}"
        evaluated.append(f"step {newest.step}")
    if before is None and after is None:
        return DASH
    text = f"{before or DASH} \u2192 {after or DASH}"
    return text + (f" (atgrpo eval: {', '.join(evaluated)})" if evaluated else "")


def cut_rates(run: Run) -> str:
    """Per agent, the share of responses cut at max_new_tokens over the run: the mean of
    rollout/<agent>/truncated_frac, else of the logged samples' ``truncated``."""
    parts = []
    for agent in run.agents:
        values = run.series(f"rollout/{agent}/truncated_frac")[1]
        if not values:
            values = [
                float(s.truncated)
                for s in run.samples
                if s.agent_id == agent and s.truncated is not None
            ]
        if values:
            parts.append(f"{agent} {sum(values) / len(values):.0%}")
    return " \u00b7 ".join(parts) or DASH


def _recent_mean(run: Run, key: str, n: int = 10) -> str:
    values = run.series(key)[1][-n:]
    return f"{sum(values) / len(values):.1%}" if values else DASH


def _duration(seconds: float) -> str:
    if seconds <= 0:
        return DASH
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _notes(runs: list[Run], payload: dict[str, Any]) -> str:
    notes = []
    for run, shown in zip(runs, payload["runs"], strict=True):
        if run.skipped_lines:
            notes.append(
                f"{run.name}: {run.skipped_lines} line(s) of metrics.jsonl / samples.jsonl "
                "did not parse and were skipped (a run still writing, or an older format)."
            )
        if not run.samples:
            notes.append(f"{run.name}: no samples.jsonl entries, so no rollouts to show.")
        elif len(shown["steps"]) < shown["logged_steps"]:
            notes.append(
                f"{run.name}: the rollout viewer holds {len(shown['steps'])} of "
                f"{shown['logged_steps']} logged steps, spread evenly from the first to the "
                f"last (at most {payload['max_steps']} steps per run are embedded)."
            )
    if not notes:
        return ""
    return '<ul class="notes">' + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>"


def _configs(runs: list[Run]) -> str:
    blocks = [
        f'<details class="config"><summary>config.yaml \u00b7 {escape(r.name)}</summary>'
        f"<pre>{escape(r.config_text or '(no config.yaml in the run folder)')}</pre></details>"
        for r in runs
    ]
    return '<h2 id="config">Resolved config</h2>' + "".join(blocks)


def _curves(anchor: str, title: str, plots: list[Plot], zero: list[str]) -> str:
    if not plots and not zero:
        return ""
    figures = [
        f'<figure id="fig-{escape(p.key)}" data-series="{escape(json.dumps(p.labels))}">'
        f'<img src="{p.data_uri()}" alt="{escape(p.title)}" width="600" height="330">'
        f"<figcaption>{escape(p.caption)}</figcaption></figure>"
        for p in plots
    ]
    flat = (
        f'<p class="notes">Zero at every step, so not drawn: {escape(", ".join(zero))}.</p>'
        if zero
        else ""
    )
    return (
        f'<h2 id="{anchor}">{escape(title)}</h2><div class="curves">'
        + "".join(figures)
        + "</div>"
        + flat
    )


def _evals(runs: list[Run]) -> str:
    rows = [(r.name, e) for r in runs for e in r.evals]
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for _, e in rows for k in e.values))[:12]
    head = ["run", "checkpoint", "split", *keys]
    body = [
        [name, _where(e.step), e.split, *(_value(e.values.get(k)) for k in keys)]
        for name, e in rows
    ]
    return (
        '<h2 id="evals">Checkpoint evaluations</h2><table class="evals"><tr>'
        + "".join(f"<th>{escape(h)}</th>" for h in head)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in body)
        + "</table>"
    )


def _where(step: int | None) -> str:
    return "untrained (run folder)" if step is None else f"step {step}"


def _value(x: float | None) -> str:
    if x is None:
        return DASH
    return f"{x:.4g}"


def _viewer(payload: dict[str, Any]) -> str:
    limit = payload["max_steps"]
    return (
        '<h2 id="viewer">Rollouts</h2>'
        '<div class="viewer-bar">'
        '<label>run <select id="sel-run"></select></label>'
        '<label>step <select id="sel-step"></select></label>'
        '<label>task <select id="sel-task"></select></label>'
        '<span class="info" id="task-info"></span></div>'
        '<div class="hash-note" id="hash-note" hidden></div>'
        f'<div class="viewer-note">One row per action (turn, then agent in the workflow\'s '
        f"order) with its K branches; the kept branch is outlined in green and the kept path "
        f"drawn through the parent links. At most {limit} steps per run are embedded. "
        f'<span id="run-note"></span></div>'
        '<div class="tree" id="tree"></div>'
    )
