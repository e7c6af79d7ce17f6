"""The report's curves: matplotlib figures rendered to PNG bytes, several runs in one axes.

Figures are built with ``matplotlib.figure.Figure`` and saved by the Agg canvas, never through
pyplot: no global state, no display, no GUI backend. Each plot returns the legend entries it
drew, so the page (and its tests) can tell which series are in an image.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from atgrpo.report.data import Run

SMOOTH_MIN = 20  # from this many points a moving average is drawn over the raw (faint) curve
PALETTE = [
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
]
LINESTYLES = ["-", "--", ":", "-."]


@dataclass(frozen=True)
class Curve:
    label: str  # within a run: an agent, a policy, a split, a stage; "" when it is the only one
    steps: list[int]
    values: list[float]
    points: bool = False  # a few evaluations (test before / after): markers and their values


@dataclass(frozen=True)
class Plot:
    key: str
    title: str
    caption: str
    png: bytes
    labels: list[str]  # the legend's entries, as drawn
    section: str = "learning"

    def data_uri(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")


CurvesOf = Callable[[Run], list[Curve]]


@dataclass(frozen=True)
class PlotSpec:
    key: str
    title: str
    ylabel: str
    caption: str
    curves: CurvesOf
    unit_range: bool = False  # a rate in [0, 1]
    section: str = "learning"  # "learning": next to the rollouts; "signal": the optimiser, cost
    log_y: bool = False  # a log axis when the values span more than a decade (LRs of runs)


@dataclass(frozen=True)
class Figures:
    plots: list[Plot]
    zero: list[str]  # titles of metrics that were logged but zero at every step of every run


def run_color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _curve(label: str, run: Run, key: str, points: bool = False) -> Curve:
    steps, values = run.series(key)
    return Curve(label, steps, values, points)


def per_agent(metric: str) -> CurvesOf:
    return lambda run: [_curve(a, run, f"reward/{a}/{metric}") for a in run.agents]


def agent_tokens(run: Run) -> list[Curve]:
    return [_curve(a, run, f"rollout/{a}/response_tokens") for a in run.agents]


def agent_truncated(run: Run) -> list[Curve]:
    return [_curve(a, run, f"rollout/{a}/truncated_frac") for a in run.agents]


def splits(metric: str) -> CurvesOf:
    """Training rollouts, validation during training, the test split before and after."""
    return lambda run: [
        _curve("train", run, f"rollout/{metric}"),
        _curve("validation", run, f"eval/{metric}"),
        _curve("test", run, f"test/{metric}", points=True),
    ]


def per_policy(prefix: str, name: str) -> CurvesOf:
    """``<prefix>/<name>`` with one policy, ``<prefix>/<policy>/<name>`` with several."""

    def curves(run: Run) -> list[Curve]:
        own = [_curve("", run, f"{prefix}/{name}")] if f"{prefix}/{name}" in run.metrics else []
        rx = rf"{prefix}/[^/]+/{name}"
        return own + [_curve(k.split("/")[1], run, k) for k in run.keys(rx)]

    return curves


def learning_rate(run: Run) -> list[Curve]:
    own = [_curve("", run, "perf/lr")] if "perf/lr" in run.metrics else []
    return own + [_curve(k.split("/")[2], run, k) for k in run.keys(r"perf/lr/[^/]+")]


def silent_groups(run: Run) -> list[Curve]:
    """Per (agent, turn) when logged (``groups/<agent>/t<turn>/``), else over all groups."""
    keys = run.keys(r"groups/[^/]+/t\d+/zero_std_frac")
    if not keys:
        return [_curve("all groups", run, "rollout/adv_zero_std_frac")]
    return [_curve(" ".join(k.split("/")[1:3]), run, k) for k in keys]


def timings(run: Run) -> list[Curve]:
    keys = [k for k in run.keys(r"perf/[^/]+_s") if not k.endswith("_per_s")]  # not rates
    return [_curve(k.removeprefix("perf/").removesuffix("_s"), run, k) for k in keys]


SIGNAL = "signal"
SPECS: list[PlotSpec] = [
    PlotSpec(
        "reward",
        "Reward per agent",
        "mean reward",
        "Mixed reward (team and local) over all K samples of each agent, per training step.",
        per_agent("mean"),
    ),
    PlotSpec(
        "valid",
        "Valid-format rate per agent",
        "valid fraction",
        "Share of each agent's samples that parsed into a legal action.",
        per_agent("valid"),
        unit_range=True,
    ),
    PlotSpec(
        "success",
        "Success",
        "success rate",
        "Training rollouts (the kept path), validation during training, held-out test before "
        "training (step 0) and after.",
        splits("success"),
        unit_range=True,
    ),
    PlotSpec(
        "team_return",
        "Team return",
        "team return",
        "The team reward where each episode ended.",
        splits("team_return"),
        section=SIGNAL,
    ),
    PlotSpec(
        "loss",
        "Loss",
        "loss",
        "PPO-clip loss, per policy when there are several.",
        per_policy("loss", "loss"),
        section=SIGNAL,
    ),
    PlotSpec("kl", "KL to the reference", "KL", "", per_policy("loss", "kl"), section=SIGNAL),
    PlotSpec(
        "clip_frac",
        "Clip fraction",
        "clipped share",
        "Share of tokens whose ratio was clipped.",
        per_policy("loss", "clip_frac"),
        section=SIGNAL,
    ),
    PlotSpec("entropy", "Entropy", "entropy", "", per_policy("loss", "entropy"), section=SIGNAL),
    PlotSpec(
        "grad_norm",
        "Gradient norm",
        "norm",
        "Before clipping.",
        per_policy("loss", "grad_norm"),
        section=SIGNAL,
    ),
    PlotSpec(
        "silent_groups",
        "Groups without signal",
        "share of groups",
        "Advantage groups whose rewards all tied: zero advantage, nothing to learn from.",
        silent_groups,
        unit_range=True,
        section=SIGNAL,
    ),
    PlotSpec("lr", "Learning rate", "LR", "", learning_rate, section=SIGNAL, log_y=True),
    PlotSpec(
        "tokens",
        "Response length per agent",
        "tokens",
        "Mean sampled tokens per response.",
        agent_tokens,
        section=SIGNAL,
    ),
    PlotSpec(
        "truncated",
        "Responses cut at the token cap per agent",
        "cut share",
        "Share of each agent's responses that reached max_new_tokens without ending "
        "(rollout.truncation says what training does with them).",
        agent_truncated,
        unit_range=True,
        section=SIGNAL,
    ),
    PlotSpec(
        "timings",
        "Stage timings",
        "seconds",
        "Wall time of the stages of a step; step is the whole step.",
        timings,
        section=SIGNAL,
    ),
]


def make_plots(runs: list[Run]) -> Figures:
    """Every plot of SPECS with data in at least one run; flat zeros are only named.

    A metric that is zero throughout (KL without a KL term, the clip fraction of one update
    per rollout) would be a flat line; a sentence says as much in less space.
    """
    plots: list[Plot] = []
    zero: list[str] = []
    for spec in SPECS:
        series = _series(spec, runs)
        if series and all(v == 0 for _, _, c in series for v in c.values):
            zero.append(spec.title)
        elif series:
            plots.append(draw_plot(spec, runs, series))
    return Figures(plots, zero)


def _series(spec: PlotSpec, runs: list[Run]) -> list[tuple[int, Run, Curve]]:
    return [(i, run, c) for i, run in enumerate(runs) for c in spec.curves(run) if c.steps]


def draw_plot(spec: PlotSpec, runs: list[Run], series: list[tuple[int, Run, Curve]]) -> Plot:
    fig = Figure(figsize=(6.0, 3.3), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    labels_in_run: dict[int, list[str]] = {}
    drawn: list[str] = []
    smoothed = 0
    for i, run, curve in series:
        slot = labels_in_run.setdefault(i, [])
        slot.append(curve.label)
        style = _style(i, len(slot) - 1, len(runs))
        label = _legend_label(run.name, curve.label, len(runs))
        smoothed = max(smoothed, _draw_curve(ax, curve, label, style, spec.unit_range))
        drawn.append(label)
    # One unnamed series of one run needs no legend: the title says what it is.
    _decorate(ax, spec, legend=len(drawn) > 1 or len(runs) > 1)
    values = [v for _, _, c in series for v in c.values]
    if spec.log_y and min(values) > 0 and max(values) > 10 * min(values):
        ax.set_yscale("log")
    caption = spec.caption
    if smoothed:
        caption += f" Faint: every step; bold: a centred mean over {smoothed} steps."
    return Plot(spec.key, spec.title, caption.strip(), _png(fig), drawn, spec.section)


def _legend_label(run: str, label: str, num_runs: int) -> str:
    if num_runs == 1:
        return label or run
    return f"{run} · {label}" if label else run


def _style(run_idx: int, curve_idx: int, num_runs: int) -> tuple[str, str]:
    # One colour per run when runs are compared; with one run, one colour per series.
    if num_runs == 1:
        return run_color(curve_idx), "-"
    return run_color(run_idx), LINESTYLES[curve_idx % len(LINESTYLES)]


def _draw_curve(
    ax: Axes, curve: Curve, label: str, style: tuple[str, str], unit_range: bool
) -> int:
    """Draw one series; returns the moving average's width, 0 when drawn raw."""
    color, linestyle = style
    x, y = curve.steps, curve.values
    if curve.points:
        ax.plot(x, y, color=color, linestyle=":", marker="D", markersize=6, label=label)
        for xi, yi in zip(x, y, strict=True):
            text = f"{yi:.1%}" if unit_range else f"{yi:+.3f}"
            ax.annotate(
                text,
                (xi, yi),
                textcoords="offset points",
                xytext=(3, 7),
                fontsize=9,
                fontweight="bold",
                color=color,
                # Kept legible where a training curve crosses the label.
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85},
            )
        return 0
    marker = "o" if len(x) <= 40 else None
    if len(x) < SMOOTH_MIN:
        ax.plot(x, y, color=color, linestyle=linestyle, marker=marker, markersize=3, label=label)
        return 0
    half = _half_width(len(y))
    ax.plot(x, y, color=color, linestyle=linestyle, linewidth=0.8, alpha=0.3)
    ax.plot(x, moving_average(y, half), color=color, linestyle=linestyle, linewidth=2, label=label)
    return 2 * half + 1


def _half_width(n: int) -> int:
    return max(1, n // 20)  # a window of about a tenth of the curve


def moving_average(values: list[float], half: int) -> list[float]:
    """A centred mean over ``2 * half + 1`` points, narrower at the ends."""
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half) : i + half + 1]
        out.append(sum(window) / len(window))
    return out


def _decorate(a: Axes, spec: PlotSpec, legend: bool) -> None:
    a.set_title(spec.title, fontsize=11, loc="left")
    a.set_xlabel("step", fontsize=9)
    a.set_ylabel(spec.ylabel, fontsize=9)
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.tick_params(labelsize=8)
    a.grid(True, alpha=0.25)
    if spec.unit_range:
        a.set_ylim(-0.03, 1.08)
    if legend:
        a.legend(fontsize=8, frameon=False, loc="best")


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    # No "Software" text chunk: it carries matplotlib's web address, and the page has none.
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()
