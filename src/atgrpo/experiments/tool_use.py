"""Does the team use its tool? Turn-by-turn figures from an evaluation's samples file.

``atgrpo eval`` (and ``atgrpo compare``) write every held-out episode's samples beside the
eval json (``eval-<split>-samples.jsonl``). In a tool team each turn has a tool sample (its
program's output read as an answer) and an actor sample (the planner's moves, the reasoner's
answer). :func:`tool_use` pairs them and measures what the success rate alone cannot say: how
often the tool's answer is right, how often the actor's answer is the tool's, and whether the
actor follows the tool when the tool is right more than when it is wrong. With the ablation
(``--ablate tool``) it tells a team that learned to use its tool from an actor that learned to
work alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atgrpo.training.metrics import read_metrics

# (answer key, right key) of the env families' info, by the env's instance_key prefix; an env
# not listed is recognised by the keys its samples have.
KNOWN_KEYS = {
    "plan_path": ("moves", "plan_reaches_goal"),
    "sokoban": ("moves", "solved"),  # the tool's "solved": its moves applied to a copy
    "math": ("answer", "correct"),
}
TOP = 5  # most common tool answers / programs listed


@dataclass
class Rates:
    """Counts over paired turns; rates are in [0, 1], None without a turn to divide by."""

    turns: int = 0
    counts: Counter[str] = field(default_factory=Counter)

    def rate(self, name: str, of: str = "turns") -> float | None:
        base = self.turns if of == "turns" else self.counts[of]
        return self.counts[name] / base if base else None


@dataclass
class ToolUse:
    tool: str
    actor: str
    answer_key: str
    right_key: str
    rates: Rates
    tool_answers: list[tuple[str, int]]  # the most common valid tool answers, with counts
    tool_programs: list[tuple[str, int]]  # the most common programs (first line), with counts

    def summary(self) -> dict[str, Any]:
        r = self.rates
        return {
            "turns": r.turns,
            "tool_valid": r.rate("tool_valid"),
            "tool_right": r.rate("tool_right"),
            "actor_right": r.rate("actor_right"),
            "actor_is_tool": r.rate("follows", of="tool_valid"),
            "actor_right_when_tool_right": r.rate("right_and_tool_right", of="tool_right"),
            "actor_is_tool_when_tool_right": r.rate("follows_and_tool_right", of="tool_right"),
            "actor_right_when_tool_wrong": r.rate("right_and_tool_wrong", of="tool_wrong"),
            "actor_is_tool_when_tool_wrong": r.rate("follows_and_tool_wrong", of="tool_wrong"),
            "tool_answers": self.tool_answers,
            "tool_programs": self.tool_programs,
        }


def read_samples(path: Path) -> list[dict[str, Any]]:
    try:
        return read_metrics(path)  # the project's JSONL reader (one object per line)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror}); run atgrpo eval first") from exc


def tool_use(
    records: list[dict[str, Any]],
    tool: str = "tool",
    actor: str | None = None,
    keys: tuple[str, str] | None = None,
) -> ToolUse:
    """Pair each turn's tool and actor samples (same task, episode and turn) and count."""
    agents = {r["agent_id"] for r in records}
    if tool not in agents:
        raise ValueError(f"no samples of agent {tool!r} (agents: {sorted(agents)}); use --tool")
    actor = actor or _other_agent(agents, tool)
    answer_key, right_key = keys or _known_keys(records)
    turns: dict[tuple[int, int, int], dict[str, dict[str, Any]]] = {}
    for r in records:
        turns.setdefault((r["task_id"], r["branch_idx"], r["turn_idx"]), {})[r["agent_id"]] = r
    rates, answers, programs = Rates(), Counter[str](), Counter[str]()
    for pair in turns.values():
        if tool in pair and actor in pair:
            _count(rates, pair[tool], pair[actor], answer_key, right_key)
            if pair[tool]["valid"]:
                answers[str(pair[tool]["info"].get(answer_key))] += 1
                programs[_first_line(pair[tool]["response"])] += 1
    return ToolUse(
        tool,
        actor,
        answer_key,
        right_key,
        rates,
        answers.most_common(TOP),
        programs.most_common(TOP),
    )


def _count(rates: Rates, t: dict[str, Any], a: dict[str, Any], answer: str, right: str) -> None:
    rates.turns += 1
    tool_right = bool(t["info"].get(right)) and bool(t["valid"])
    actor_right = bool(a["info"].get(right)) and bool(a["valid"])
    follows = bool(t["valid"]) and a["valid"] and t["info"].get(answer) == a["info"].get(answer)
    case = "tool_right" if tool_right else "tool_wrong" if t["valid"] else "tool_invalid"
    flags = {
        "tool_valid": bool(t["valid"]),
        "tool_right": tool_right,
        "tool_wrong": case == "tool_wrong",
        "actor_right": actor_right,
        "follows": follows,
        f"right_and_{case}": actor_right,
        f"follows_and_{case}": follows,
    }
    rates.counts.update(name for name, on in flags.items() if on)


def _other_agent(agents: set[str], tool: str) -> str:
    others = sorted(agents - {tool})
    if len(others) != 1:
        raise ValueError(f"agents {sorted(agents)}: name the actor with --actor")
    return others[0]


def _known_keys(records: list[dict[str, Any]]) -> tuple[str, str]:
    envs = {str(r.get("instance_key") or "").split(":")[0] for r in records}
    if len(envs) == 1 and (env := envs.pop()) in KNOWN_KEYS:
        return KNOWN_KEYS[env]
    seen = {k for r in records for k in r.get("info", {})}
    for answer, right in KNOWN_KEYS.values():
        if answer in seen and right in seen:
            return answer, right
    raise ValueError(
        f"the samples' info has none of the known answer / right keys "
        f"{list(KNOWN_KEYS.values())}; give them with --keys ANSWER,RIGHT"
    )


def _first_line(program: str) -> str:
    lines = [line.strip() for line in program.strip().splitlines() if line.strip()]
    return lines[0][:80] if lines else ""


def format_tool_use(result: ToolUse) -> str:
    """The summary as a few lines of text for the terminal."""
    s = result.summary()

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f} %"

    lines = [
        f"{s['turns']} turns with a {result.tool} and a {result.actor} sample "
        f"(answer: info.{result.answer_key}, right: info.{result.right_key})",
        f"{result.tool}: valid {pct(s['tool_valid'])}, right {pct(s['tool_right'])}",
        f"{result.actor}: right {pct(s['actor_right'])}; its answer is the {result.tool}'s "
        f"in {pct(s['actor_is_tool'])} of turns with a valid {result.tool} answer",
        f"when the {result.tool} is right: {result.actor} right "
        f"{pct(s['actor_right_when_tool_right'])}, follows it "
        f"{pct(s['actor_is_tool_when_tool_right'])}",
        f"when the {result.tool} is wrong: {result.actor} right "
        f"{pct(s['actor_right_when_tool_wrong'])}, follows it "
        f"{pct(s['actor_is_tool_when_tool_wrong'])}",
        f"most common {result.tool} answers: "
        + ", ".join(f"{a!r} x{n}" for a, n in result.tool_answers),
        "most common first lines of its programs: "
        + ", ".join(f"{p!r} x{n}" for p, n in result.tool_programs),
    ]
    return "\n".join(lines)
