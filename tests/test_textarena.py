"""TextArena games as envs: copies that share nothing, seeds, rewards, invalid moves, load-time
errors, the opponents' rules and check_env on every game docs/textarena.md names."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

pytest.importorskip("textarena")

from atgrpo.config import ConfigError, load_config
from atgrpo.envs import check_env, make_env
from atgrpo.envs.textarena import ACTION_CHARS, TextArenaEnv
from atgrpo.envs.textarena_opponents import (
    RandomOpponent,
    RuleOpponent,
    fixed_opponent,
    legal_moves,
)

# The games with a legal-move generator (the random opponent, the playout credit), then the
# others docs/textarena.md names.
LEGAL_MOVE_GAMES = ("KuhnPoker-v0", "TicTacToe-v0", "SimpleNegotiation-v0", "LiarsDice-v0")
NAMED_GAMES = (
    *LEGAL_MOVE_GAMES,
    "ConnectFour-v0",
    "Nim-v0",
    "IteratedPrisonersDilemma-v0",
    "GameOfPureStrategy-v0",
)


def _env(game: str = "KuhnPoker-v0", *overrides: str) -> TextArenaEnv:
    cfg = load_config(None, ["env.name=textarena", f"env.game={game}", *overrides])
    env = make_env(cfg.env)
    assert isinstance(env, TextArenaEnv)
    return env


def _view(env: TextArenaEnv) -> str:
    """Everything a copy must not change: prompts, turn, and the game's own state."""
    prompts = [env.observe(a) for a in env.possible_agents] if not env.done else None
    state = env.game.state
    return json.dumps(
        [prompts, env.agent_selection, env.turn_idx, state.game_state, state.logs], default=repr
    )


def test_branches_of_one_turn_never_share_game_state() -> None:
    env = _env("KuhnPoker-v0", "env.game_kwargs={max_rounds: 3}")
    env.reset(seed=7)
    before = _view(env)
    branch, sibling = env.clone(), env.clone()
    assert branch.game is not env.game and branch.game.state is not env.game.state
    branch.step("[bet]")
    branch.step("[fold]")  # ends the round: the next round's deal draws from the branch's RNG
    assert _view(env) == before and _view(sibling) == before
    assert branch.game.state.game_state["current_round"] == 2
    # The sibling, stepped alike after the interpreter's random was used in between, deals the
    # branch's next cards: each copy draws from its own RNG state, not from the global one.
    random.random()
    sibling.step("[bet]")
    sibling.step("[fold]")
    assert (
        sibling.game.state.game_state["player_cards"]
        == (branch.game.state.game_state["player_cards"])
    )


def test_the_same_seed_gives_the_same_game_and_splits_differ() -> None:
    a, b = _env("LiarsDice-v0"), _env("LiarsDice-v0")
    a.reset(seed=3)
    random.seed(12345)  # the global RNG's state does not matter
    b.reset(seed=3)
    assert _view(a) == _view(b)
    for env in (a, b):
        env.step("[Bid: 2, 3]")
        env.step("[Call]")
    assert _view(a) == _view(b)
    b.reset(seed=3, options={"split": "test"})
    assert a.instance_key != b.instance_key
    assert a.game.state.game_state["dice_rolls"] != b.game.state.game_state["dice_rolls"]


def test_a_deciding_move_is_scored_by_the_outcome_and_others_by_playouts() -> None:
    env = _env("KuhnPoker-v0", "env.game_kwargs={max_rounds: 1}")
    env.reset(seed=1)
    opener = env.agent_selection
    bet = env.clone().step("[bet]")
    assert bet.valid and bet.local_reward == 0.0 and -1.0 <= bet.team_reward <= 1.0
    assert env.clone().step("[bet]").team_reward == bet.team_reward  # deterministic
    folded = env.clone()
    folded.step("[bet]")
    fold = folded.step("[fold]")
    assert folded.done and folded.success
    assert fold.team_reward == -1.0 and fold.info["outcome"][opener] == 1.0
    none = _env("KuhnPoker-v0", "env.game_kwargs={max_rounds: 1}", "env.playouts=0")
    none.reset(seed=1)
    assert none.step("[bet]").team_reward == 0.0


def test_invalid_moves_follow_the_games_rule_and_are_recorded() -> None:
    env = _env("TicTacToe-v0", "env.invalid_move_penalty=0.5")
    env.reset(seed=0)
    mover = env.agent_selection
    first = env.step("I think the centre")  # TextArena: one retry, then the move loses
    assert not first.valid and first.local_reward == -0.5 and first.info["invalid_move"]
    assert env.agent_selection == mover and not env.done
    second = env.step("[42]")
    assert not second.valid and env.done and not env.success
    assert second.team_reward == -1.0 and env.outcome is not None and env.outcome[mover] == -1.0


def test_the_answer_prefix_is_primed_and_the_game_reads_it_with_the_completion() -> None:
    env = _env("KuhnPoker-v0", "env.answer_prefix=My move is [")
    env.reset(seed=0)
    mover = env.agent_selection
    assert env.observe(mover)[-1] == {"role": "assistant", "content": "My move is ["}
    played = env.step("check] because")  # alone not a move: the game reads "My move is [check]"
    assert played.valid and "[check]" in played.info["game_messages"]
    plain = _env("KuhnPoker-v0")
    plain.reset(seed=0)
    assert plain.observe(mover)[-1]["role"] == "user"
    assert not plain.step("check] because").valid


def _after_two_moves(observation: str) -> str:
    """Player 0's prompt after an opening on square 4 and a reply on square 0."""
    env = _env("TicTacToe-v0", f"env.observation={observation}")
    env.reset(seed=0)
    env.step("[4] since the centre is strong")
    env.step("[0]")
    return str(env.observe(env.agent_selection)[-1]["content"])


def test_the_observation_mode_decides_what_a_prompt_shows_of_the_game() -> None:
    """history shows every answer and board; game_messages the game's words and the latest
    board; board the latest board alone, as TextArena's three observation wrappers do."""
    history, messages, board = map(_after_two_moves, ("history", "game_messages", "board"))
    latest = " X | 1 | 2 \n---+---+---\n 3 | O | 5"
    for prompt in (history, messages, board):
        assert latest in prompt and prompt.endswith("only that bracketed move is read.")
    assert "the centre is strong" in history and history.count("Current Board") == 3
    assert "the centre is strong" not in messages and messages.count("Current Board") == 1
    assert "placed their symbol (O) in cell 4" in messages
    assert board.count("[GAME]") == 1 and "placed their symbol" not in board
    assert messages.index("in cell 0") < messages.index(latest)  # the board comes last


def test_the_game_reads_a_long_answer_up_to_its_cap_and_the_cut_is_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ConnectFour reads a move with `.*\\[(\\d+)\\].*`: minutes on a 1 MB answer uncut."""
    env = _env("ConnectFour-v0")
    env.reset(seed=0)
    read: list[int] = []
    step = env.game.step
    monkeypatch.setattr(env.game, "step", lambda action: read.append(len(action)) or step(action))
    cut = env.step("[3]" + "x" * 1_000_000)
    assert read == [ACTION_CHARS] and cut.valid and cut.info["answer_cut_at"] == ACTION_CHARS
    assert "answer_cut_at" not in env.step("[3] short").info


def _movers(env: TextArenaEnv) -> list[str]:
    """The agents the rollout is asked to move until the game ends (each plays ``[check]`` or
    ``[call]``, legal in every Kuhn position but a fold's)."""
    movers = []
    while not env.done:
        movers.append(env.agent_selection)
        moves = legal_moves(env.game, env.possible_agents.index(env.agent_selection)) or []
        env.step(next(m for m in ("[check]", "[call]", "[fold]") if m in moves))
    return movers


def test_a_training_opponent_takes_one_seat_of_a_share_of_training_games_only() -> None:
    share = ("env.train_opponent=random", "env.game_kwargs={max_rounds: 1}")
    seated = []
    for seed in range(40):
        env = _env("KuhnPoker-v0", *share)
        env.reset(seed=seed, options={"split": "train"})
        sibling = env.clone()
        movers = _movers(env)
        assert movers == _movers(sibling)  # a copy plays the same seats: the draw is the game's
        seated.append(len(set(movers)) == 1)
        if seated[-1]:
            assert env.infos[movers[0]]["train_opponent"] == {
                next(a for a in env.possible_agents if a not in movers): "random"
            }
    assert 10 < sum(seated) < 30  # the default share, one half
    for split in ("validation", "test"):
        held_out = _env("KuhnPoker-v0", *share)
        held_out.reset(seed=3, options={"split": split})
        assert sorted(set(_movers(held_out))) == ["player_0", "player_1"]
    always = _env("KuhnPoker-v0", *share, "env.train_opponent_share=1")
    never = _env("KuhnPoker-v0", *share, "env.train_opponent_share=0")
    for env, seats in ((always, 1), (never, 2)):
        env.reset(seed=5, options={"split": "train"})
        assert len(set(_movers(env))) == seats


def test_playouts_change_no_game_so_held_out_matches_leave_them_out() -> None:
    from atgrpo.envs import Split
    from atgrpo.experiments.matches import _game

    credited, plain = _env("KuhnPoker-v0", "env.playouts=8"), _env("KuhnPoker-v0", "env.playouts=0")
    for env in (credited, plain):
        env.reset(seed=5)
        env.set_opponents({env.possible_agents[1]: RandomOpponent()})
    rng = random.Random(0)
    while not credited.done:
        move = rng.choice(legal_moves(credited.game, credited.game.state.current_player_id))
        a, b = credited.step(move), plain.step(move)
        assert a.info == b.info and _view(credited) == _view(plain)
    cfg = load_config(None, ["env.name=textarena", "env.game=KuhnPoker-v0", "env.playouts=8"])
    assert _game(cfg, seed=5, split=Split.TEST).config.playouts == 0


@pytest.mark.parametrize("game", NAMED_GAMES)
def test_check_env_passes_on_every_named_game(game: str) -> None:
    env = _env(game, "env.playouts=2")
    check_env(env, seeds=(0, 1), factory=lambda: _env(game, "env.playouts=2"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["env.game=KuhnPoker-v9"], "not a TextArena env id (did you mean 'KuhnPoker-v0'?)"),
        (["env.players=[a, b, c]"], "cannot be played by 3 player(s)"),
        (["env.game_kwargs={rounds: 2}"], "env.game_kwargs do not fit 'KuhnPoker-v0'"),
        (["env.players=[a, a]"], "names an agent twice"),
        (["env.observation=boards"], "'history', 'game_messages' or 'board' (got 'boards')"),
        (
            ["env.game=SimpleNegotiation-v0", "env.train_opponent=rule"],
            "env.train_opponent: no rule-based opponent for SimpleNegotiationEnv",
        ),
    ],
)
def test_a_bad_game_section_is_one_line_at_load_time(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["env.name=textarena", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)


def _kuhn(seed: int, card: int) -> TextArenaEnv:
    env = _env("KuhnPoker-v0", "env.game_kwargs={max_rounds: 1}")
    env.reset(seed=seed)
    env.game.state.game_state["player_cards"][env.game.state.current_player_id] = card
    return env


def test_the_kuhn_rule_bets_and_calls_a_king_and_folds_a_jack_to_a_bet() -> None:
    rule, rng = RuleOpponent(), random.Random(0)
    for seed in range(4):
        opener = _kuhn(seed, 2)
        pid = opener.game.state.current_player_id
        assert rule.move(opener.game, pid, rng) == "[bet]"  # K opens with a bet
        assert rule.move(_kuhn(seed, 1).game, pid, rng) == "[check]"  # Q checks
        facing = _kuhn(seed, 2)
        facing.step("[bet]")
        other = facing.game.state.current_player_id
        facing.game.state.game_state["player_cards"][other] = 2
        assert rule.move(facing.game, other, rng) == "[call]"  # K calls
        facing.game.state.game_state["player_cards"][other] = 0
        assert rule.move(facing.game, other, rng) == "[fold]"  # J folds
    jacks = [_kuhn(0, 0) for _ in range(300)]
    bluffs = sum(rule.move(e.game, e.game.state.current_player_id, rng) == "[bet]" for e in jacks)
    assert 70 <= bluffs <= 130  # a J bluffs one time in three


def test_the_tictactoe_rule_wins_then_blocks() -> None:
    env = _env("TicTacToe-v0")
    env.reset(seed=0)
    pid = env.game.state.current_player_id
    mine, theirs = ("X", "O") if pid == 1 else ("O", "X")
    board = env.game.state.game_state["board"]
    board[0][0], board[0][1] = theirs, theirs  # they threaten 2
    board[2][0], board[2][1] = mine, mine  # we can win at 8
    assert RuleOpponent().move(env.game, pid, random.Random(0)) == "[8]"
    board[2][1] = ""
    assert RuleOpponent().move(env.game, pid, random.Random(0)) == "[2]"


def test_the_random_opponent_plays_only_legal_moves() -> None:
    for game in LEGAL_MOVE_GAMES:
        env = _env(game, "env.playouts=0")
        env.reset(seed=0)
        env.set_opponents({env.possible_agents[1]: RandomOpponent()})
        rng = random.Random(0)
        while not env.done:
            pid = env.game.state.current_player_id
            assert not env.step(rng.choice(legal_moves(env.game, pid) or [""])).info["invalid_move"]
        assert env.success, game
    with pytest.raises(ValueError, match="no rule-based opponent for LiarsDiceEnv"):
        fixed_opponent("rule", _started("LiarsDice-v0").game)


def _started(game: str) -> TextArenaEnv:
    env = _env(game)
    env.reset(seed=0)
    return env


def test_importing_atgrpo_envs_does_not_import_textarena() -> None:
    probe = "import sys, atgrpo.envs; print('textarena' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
