"""Parsing model completions into actions. Every function here returns ``None`` on a malformed
completion and never raises, whatever the text (empty, garbage, megabytes, control characters,
lone surrogates): a malformed completion is an invalid action that the env scores, not an error.
"""

from __future__ import annotations

import bisect
import re

# Moves on a grid: U = row - 1, D = row + 1, L = column - 1, R = column + 1.
MOVE_WORDS: dict[str, str] = {
    "u": "U",
    "d": "D",
    "l": "L",
    "r": "R",
    "up": "U",
    "down": "D",
    "left": "L",
    "right": "R",
}

_FENCE = "```"
# A language tag after an opening fence: ```python, ```py3, ```c++ ...
_LANG_TAG = re.compile(r"[A-Za-z0-9_+.\-]*[ \t]*")
_LABEL = re.compile(r"moves\s*:", re.IGNORECASE)
# Words: anything between separators (spaces, commas, brackets, quotes, arrows, ...).
_WORD = re.compile(r"[A-Za-z0-9_]+")
_COMPACT = re.compile(r"[UDLR]+")  # "RRDD": a program that prints "".join(path)
_NEXT_LINE = re.compile(r"\s*([^\n]*)")  # the next non-blank line
_NON_BLANK = re.compile(r"\S")


def without_surrogates(text: str) -> str:
    """``text`` with lone surrogates replaced by '?', so it can be encoded as UTF-8."""
    return text.encode("utf-8", errors="replace").decode("utf-8")


def extract_code(text: str) -> str | None:
    """The last non-empty fenced code block of ``text`` (```python ... ``` or ``` ... ```).

    Fences pair up in order; an unterminated final fence runs to the end of the text (a
    completion cut by the token limit still yields its program). The language tag line is
    dropped; lone surrogates become '?'. ``None`` when there is no non-empty block.
    """
    starts = [m.start() for m in re.finditer(_FENCE, text)]
    blocks: list[str] = []
    for i in range(0, len(starts), 2):
        begin = starts[i] + len(_FENCE)
        end = starts[i + 1] if i + 1 < len(starts) else len(text)
        body = text[begin:end]
        first_line, newline, rest = body.partition("\n")
        if _LANG_TAG.fullmatch(first_line):
            body = rest if newline else ""
        blocks.append(body)
    for body in reversed(blocks):
        if body.strip():
            return without_surrogates(body.strip("\n"))
    return None


def _moves_in(
    text: str, pos: int, endpos: int, max_moves: int, stop_at_other_words: bool
) -> list[str]:
    # pos/endpos rather than slices: a megabyte of labels must not cost a copy per label.
    moves: list[str] = []
    for match in _WORD.finditer(text, pos, endpos):
        word = match.group()
        if word.lower() in MOVE_WORDS:
            moves.append(MOVE_WORDS[word.lower()])
        elif _COMPACT.fullmatch(word):
            moves.extend(word)
        elif stop_at_other_words:
            break
        if len(moves) >= max_moves:
            break
    return moves[:max_moves]


def parse_moves(text: str, require_label: bool = True, max_moves: int = 100) -> list[str] | None:
    """Moves ("U", "D", "L", "R") read from ``text``, at most ``max_moves`` of them.

    Label mode (a planner's answer): the last ``Moves:`` label (any case) that is followed by at
    least one move, on the rest of its line or, when that is blank, the next non-blank line.
    Tokens are separated by spaces, commas, brackets, quotes or arrows; ``up``/``down``/``left``
    /``right`` map to letters and a compact run like ``RRD`` counts as three moves; reading stops
    at the first other word ("Moves: R R D then stop" gives R R D).

    Without the label (a program's stdout): every standalone move token of the text.

    ``None`` when nothing parses: no label, or no moves.
    """
    if max_moves < 1:
        return None
    if not require_label:
        return _moves_in(text, 0, len(text), max_moves, stop_at_other_words=False) or None
    newlines = [m.start() for m in re.finditer("\n", text)]
    for label in reversed(list(_LABEL.finditer(text))):
        i = bisect.bisect_left(newlines, label.end())
        line_end = newlines[i] if i < len(newlines) else len(text)
        start, end = label.end(), line_end
        if not _NON_BLANK.search(text, start, end):  # "Moves:\nR R D"
            next_line = _NEXT_LINE.match(text, line_end)
            start, end = (next_line.start(1), next_line.end(1)) if next_line else (0, 0)
        moves = _moves_in(text, start, end, max_moves, stop_at_other_words=True)
        if moves:
            return moves
    return None
