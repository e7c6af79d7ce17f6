"""Tree and independent rollouts on Plan-Path (invariants 1, 2, 6 and 11 of docs/design.md).

The generator here is scripted (a test double for the model), so that the rollout's own logic
is checked on known completions; test_train_smoke.py runs the real tiny model end to end.
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from atgrpo.algo.advantage import Grouping, assign_advantages
from atgrpo.algo.rollout import EnvStepper, ThreadStepper, collect_rollout
from atgrpo.envs import PlanPathConfig, PlanPathEnv
from atgrpo.generation import Generation
from helpers import adv_settings, rollout_settings


class ScriptedGenerator:
    """Returns the scripted texts in turn for each call; token ids encode the text length."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script = script
        self.calls: list[tuple[str, list[list[int]]]] = []

    def generate(self, prompts, params):
        max_new_tokens = params.max_new_tokens
        role = "tool" if self._is_tool(prompts[0]) else "planner"
        self.calls.append((role, prompts))
        texts = self.script[role]
        out = []
        for i, _ in enumerate(prompts):
            text = texts[i % len(texts)]
            ids = [min(ord(c), 255) for c in text[:max_new_tokens]] or [0]
            out.append(Generation(ids, [-1.0] * len(ids), text, finished=True))
        return out

    @staticmethod
    def _is_tool(prompt: list[int]) -> bool:
        return bytes(t for t in prompt if t < 256).find(b"Python program") >= 0


def encode(messages):
    text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    return list(text.encode("utf-8", "replace"))


def _envs(n: int, workflow: str = "mas", seed0: int = 0) -> list[PlanPathEnv]:
    cfg = PlanPathConfig(grid_size=4, wall_ratio=0.1, workflow=workflow, max_turns=2)
    envs = []
    for i in range(n):
        env = PlanPathEnv(cfg)
        env.reset(seed=seed0 + i)
        envs.append(env)
    return envs


def _run(envs, gen, width=3, tree=True, stepper: Callable[..., EnvStepper] | None = None):
    """A rollout; ``stepper(pool)`` steps the envs (default: ``pool=``, a ThreadStepper)."""
    settings = rollout_settings({"tool": 64, "planner": 64}, width, tree=tree)
    with ThreadPoolExecutor(4) as pool:
        return collect_rollout(
            envs,
            list(range(len(envs))),
            generators={"shared": gen},
            policy_of={"tool": "shared", "planner": "shared"},
            encode=encode,
            settings=settings,
            **({"pool": pool} if stepper is None else {"stepper": stepper(pool)}),
        )


PLANS = ["Moves: U", "Moves: D D", "no answer here", "Moves: L R", "Moves: R"]
PROGRAMS = ['```python\nprint("U")\n```', "I cannot", '```python\nprint("D R")\n```']


def test_tree_groups_share_prompts_and_keep_the_best_branch() -> None:
    gen = ScriptedGenerator({"tool": PROGRAMS, "planner": PLANS})
    rollout = _run(_envs(3), gen, width=3)
    # Invariant 1: with agent_turn grouping every group holds K samples of one prompt.
    assign_advantages(
        rollout.samples, adv_settings(Grouping.AGENT_TURN), require_identical_prompts=True
    )
    groups: dict[tuple[int, str, int], list] = {}
    for s in rollout.samples:
        groups.setdefault((s.task_id, s.agent_id, s.turn_idx), []).append(s)
    assert all(len(g) == 3 for g in groups.values())
    for key, group in groups.items():
        kept = [s for s in group if s.kept]
        assert len(kept) == 1
        assert kept[0].reward == max(s.reward for s in group)
        assert rollout.kept_branches[key] == kept[0].branch_idx
    # Agents act sequentially: per turn, the tool's call comes before the planner's.
    roles = [role for role, _ in gen.calls]
    assert roles[:2] == ["tool", "planner"]


def test_planner_sees_the_kept_tool_branch() -> None:
    # Branch 2's program prints the best plan for some tasks; whichever wins, the planner's
    # prompt must show the kept program, not another branch's.
    gen = ScriptedGenerator({"tool": PROGRAMS, "planner": PLANS})
    rollout = _run(_envs(2), gen, width=3)
    tool_turn0 = [s for s in rollout.samples if s.agent_id == "tool" and s.turn_idx == 0]
    planner_prompts = [p for role, ps in gen.calls if role == "planner" for p in ps]
    for task_id in (0, 1):
        kept = next(s for s in tool_turn0 if s.task_id == task_id and s.kept)
        prompt = bytes(t for t in planner_prompts[task_id * 3] if t < 256).decode()
        if "print" in kept.response_text:
            assert kept.response_text.split("\n")[1] in prompt
        else:
            assert "no program" in prompt


def test_branches_do_not_share_state() -> None:
    env = _envs(1)[0]
    a, b = env.clone(), env.clone()
    a.step('```python\nprint("U")\n```')
    a.step("Moves: D D R")
    assert b.turn_idx == 0 and b.agent_selection == "tool"
    assert b.position == env.position == env.instance.start
    assert a.position != b.position or a.turn_idx != b.turn_idx


def test_independent_sampling_runs_k_trajectories() -> None:
    gen = ScriptedGenerator({"tool": PROGRAMS, "planner": PLANS})
    rollout = _run(_envs(2), gen, width=2, tree=False)
    assert len(rollout.episodes) == 4  # 2 tasks x 2 trajectories
    assert {(s.task_id, s.branch_idx) for s in rollout.samples} == {
        (t, k) for t in range(2) for k in range(2)
    }
    assign_advantages(rollout.samples, adv_settings(Grouping.TRAJECTORY))


class PicklingStepper:
    """Steps pickled copies of the envs and returns those, as Ray env workers do.

    The envs it is given are left as they were, so a rollout that continued from them instead
    of from the returned ones would never advance: ``max_calls`` stops it.
    """

    def __init__(self, pool: ThreadPoolExecutor, max_calls: int) -> None:
        self.inner, self.calls, self.max_calls = ThreadStepper(pool), 0, max_calls

    def step(self, envs, actions):
        self.calls += 1
        assert self.calls <= self.max_calls, "the rollout stepped more often than it has turns"
        return self.inner.step(pickle.loads(pickle.dumps(envs)), actions)


@pytest.mark.parametrize("tree", [True, False])
def test_the_rollout_continues_from_the_envs_the_stepper_returns(tree: bool) -> None:
    script = {"tool": PROGRAMS, "planner": PLANS}
    want = _run(_envs(3), ScriptedGenerator(script), width=3, tree=tree)
    steppers: list[PicklingStepper] = []

    def pickling(pool: ThreadPoolExecutor) -> PicklingStepper:
        steppers.append(PicklingStepper(pool, max_calls=4))  # 2 turns x 2 agents
        return steppers[-1]

    got = _run(_envs(3), ScriptedGenerator(script), width=3, tree=tree, stepper=pickling)
    assert steppers[0].calls == len({(s.agent_id, s.turn_idx) for s in want.samples})
    assert got.samples == want.samples  # prompts show the stepped state: the same rollout
    assert got.episodes == want.episodes and got.kept_branches == want.kept_branches


def test_collect_rollout_takes_one_stepper() -> None:
    with ThreadPoolExecutor(1) as pool, pytest.raises(TypeError, match="exactly one"):
        collect_rollout(
            _envs(1), [0], generators={}, policy_of={}, encode=encode,
            settings=rollout_settings({}, 1),
            stepper=ThreadStepper(pool), pool=pool,
        )  # fmt: skip


MALFORMED = [
    "",
    "\x00\x01\x02 garbage \ufffd",
    "Moves: " + "X" * 200_000,
    "\ud800\udfff lone surrogates",
    "Moves: U" * 50_000,
    "```python\n",
]


def test_malformed_completions_do_not_crash_a_rollout() -> None:
    gen = ScriptedGenerator({"tool": MALFORMED, "planner": MALFORMED})
    rollout = _run(_envs(2), gen, width=len(MALFORMED))
    assert len(rollout.samples) > 0
    for s in rollout.samples:
        assert s.reward == s.reward  # not NaN


@pytest.mark.skipif(os.geteuid() != 0, reason="full isolation needs root (setuid, namespaces)")
def test_hostile_tool_programs_do_not_crash_a_rollout(monkeypatch) -> None:
    monkeypatch.setenv("ATGRPO_TEST_SECRET", "hunter2-secret")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    hostile = [
        "```python\nwhile True:\n    pass\n```",
        "```python\nx = bytearray(10**10)\n```",
        "```python\nimport os\nprint(os.environ)\n"
        "print(open(f'/proc/{os.getppid()}/environ').read())\n```",
        "```python\nimport socket\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('R')\n```",
    ]
    cfg = PlanPathConfig(
        grid_size=4, wall_ratio=0.1, workflow="mas", max_turns=1, sandbox_wall_time_s=1.5
    )
    env = PlanPathEnv(cfg)
    env.reset(seed=0)
    gen = ScriptedGenerator({"tool": hostile, "planner": ["Moves: U"]})
    try:
        rollout = _run([env], gen, width=len(hostile))
    finally:
        listener.close()
    tool = [s for s in rollout.samples if s.agent_id == "tool"]
    assert len(tool) == len(hostile)
    assert all(not s.valid and s.local_reward == -cfg.format_penalty for s in tool)
    planner_prompt = bytes(t for t in gen.calls[-1][1][0] if t < 256).decode()
    assert "hunter2-secret" not in planner_prompt


TOOL_MOVES = ("U", "D", "L", "R")


class AdoptingGenerator:
    """Tool branch k prints move k of U D L R; the planner answers what the tool printed."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def generate(self, prompts, params):
        out = []
        for i, prompt in enumerate(prompts):
            text = bytes(t for t in prompt if t < 256).decode()
            if ScriptedGenerator._is_tool(prompt):
                answer = f'```python\nprint("{TOOL_MOVES[i % 4]}")\n```'
            else:
                printed = text.rsplit("It printed: ", 1)[-1].split("\n")[0]
                answer = f"Moves: {printed}"
            out.append(Generation([1], [-1.0], answer, finished=True))
        self.calls.append(("tool" if ScriptedGenerator._is_tool(prompts[0]) else "planner",
                           len(prompts)))  # fmt: skip
        return out


def _team_only_rollout(lookahead: bool, gen: AdoptingGenerator):
    settings = rollout_settings(
        {"tool": 64, "planner": 64}, 4, alpha=1.0, local_weight=0.0, lookahead=lookahead
    )
    envs = _envs(4)
    with ThreadPoolExecutor(4) as pool:
        return collect_rollout(
            envs, list(range(4)), generators={"shared": gen},
            policy_of={"tool": "shared", "planner": "shared"}, encode=encode,
            settings=settings, pool=pool,
        )  # fmt: skip


def test_lookahead_credits_the_tool_with_the_team_outcome_its_program_leads_to() -> None:
    # alpha = 1, local weight 0 (the paper's "global only"): the tool's reward is the team's.
    gen = AdoptingGenerator()
    rollout = _team_only_rollout(lookahead=True, gen=gen)
    assign_advantages(rollout.samples, adv_settings(Grouping.AGENT_TURN, alpha=1.0, local_weight=0))
    tool = [s for s in rollout.samples if s.agent_id == "tool"]
    # A program printing a move towards the goal leads the adopting planner closer: its team
    # term is higher than a program printing a move away, so tool groups carry signal.
    assert any(s.advantage != 0.0 for s in tool)
    for s in tool:
        assert s.reward == s.team_reward  # 1 * team + 0 * local
    # The cost: one planner call of B x K probes after each tool turn.
    assert ("planner", 4 * 4) in gen.calls
    assert rollout.lookahead_s > 0.0

    # Without lookahead the tool's team term is the standing before the planner acts: equal
    # across its K branches, so under alpha = 1 the tool never learns.
    flat = _team_only_rollout(lookahead=False, gen=AdoptingGenerator())
    assign_advantages(flat.samples, adv_settings(Grouping.AGENT_TURN, alpha=1.0, local_weight=0))
    assert all(s.advantage == 0.0 for s in flat.samples if s.agent_id == "tool")


def test_lookahead_probes_do_not_change_the_kept_state() -> None:
    gen = AdoptingGenerator()
    with_probes = _team_only_rollout(lookahead=True, gen=gen)
    planner = [s for s in with_probes.samples if s.agent_id == "planner"]
    # The planner's real group answers on the kept tool branch: K samples of one prompt.
    by_group: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    for s in planner:
        by_group.setdefault((s.task_id, s.turn_idx), set()).add(tuple(s.prompt_ids))
    assert all(len(prompts) == 1 for prompts in by_group.values())
    assert all(len([s for s in planner if (s.task_id, s.turn_idx) == k]) == 4 for k in by_group)


# -- eval.ablate: the team without one agent -----------------------------------------------------


def test_an_ablated_agents_answer_never_reaches_the_others_and_the_episode_runs() -> None:
    """The tool's program prints a marker; ablated, the env gets "" from the tool, so no planner
    prompt shows the marker, while the tool still generates and every episode ends."""
    marker_program = '```python\nprint("R R R")\n```'
    runs = {}
    for ablated in (frozenset(), frozenset({"tool"})):
        gen = ScriptedGenerator({"tool": [marker_program], "planner": PLANS})
        settings = rollout_settings(
            {"tool": 64, "planner": 64}, 1, temperature=None, ablated=ablated
        )
        envs = _envs(3)
        with ThreadPoolExecutor(2) as pool:
            rollout = collect_rollout(
                envs,
                [0, 1, 2],
                generators={"shared": gen},
                policy_of={"tool": "shared", "planner": "shared"},
                encode=encode,
                settings=settings,
                pool=pool,
            )
        planner_prompts = [
            bytes(t for t in p if t < 256).decode()
            for r, ps in gen.calls
            if r == "planner"
            for p in ps
        ]
        runs[ablated] = (rollout, gen, planner_prompts)
    plain, _, shown = runs[frozenset()]
    ablated_run, gen, hidden = runs[frozenset({"tool"})]
    assert any("R R R" in p for p in shown)  # without ablation the planner sees the output
    assert hidden and not any("R R R" in p or "print(" in p for p in hidden)
    assert [r for r, _ in gen.calls].count("tool") == [
        r for r, _ in runs[frozenset()][1].calls
    ].count("tool")
    assert len(ablated_run.episodes) == len(plain.episodes) == 3
    tool_samples = [s for s in ablated_run.samples if s.agent_id == "tool"]
    assert tool_samples and all(s.response_text == marker_program for s in tool_samples)


def test_ablating_an_agent_the_env_does_not_have_is_a_config_error() -> None:
    from atgrpo.config import ConfigError, load_config
    from atgrpo.training.settings import eval_rollout_settings
    from conftest import REPO

    cfg = load_config(REPO / "configs" / "tiny.yaml", ["eval.ablate=[coder]"])
    with pytest.raises(ConfigError, match=r"'eval\.ablate': the env has no agent 'coder'"):
        eval_rollout_settings(cfg, ("tool", "planner"))
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["eval.ablate=[tool]"])
    assert eval_rollout_settings(cfg, ("tool", "planner")).ablated == {"tool"}
