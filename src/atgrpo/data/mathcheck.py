"""Checking math answers: ``extract_boxed`` and ``verify`` (math-verify in child processes).

math-verify 0.7 times out with ``SIGALRM``, which works only in the main thread: called from
the rollout's worker threads it returns "wrong" for every answer, and nothing bounds a hostile
answer like ``9^{9^{9^9}}``. So :func:`verify` runs it in small child processes (at most 8,
shared by all threads) with a memory limit and a hard timeout; plain integers and identical
strings are compared in-process.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import threading
import time

from atgrpo.data.base import DatasetError
from atgrpo.parsing import without_surrogates

MAX_ANSWER_CHARS = 1000  # longer predictions are wrong without being parsed
MAX_BOXED_CANDIDATES = 16  # \boxed{ openings tried by extract_boxed, from the last
VERIFY_TIMEOUT_S = 10.0
_VERIFIER_MEMORY_MB = 2048  # RLIMIT_AS of a verifier process
# At most this many verifier processes (about 100 MB each, sympy loaded); more concurrent
# callers wait for one. Checks take milliseconds, so a few serve a whole thread pool.
_MAX_VERIFIER_PROCESSES = min(8, os.cpu_count() or 1)
_VERIFIER_STEP_TIMEOUT_S = 2  # math-verify's own (SIGALRM) limit per parse / comparison
_VERIFIER_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine


def _missing(pip_name: str, module: str, what: str) -> str:
    return (
        f"{pip_name} is not installed (needed for {what}): pip install {pip_name} "
        f"(or the atgrpo[math] extra); `python -c 'import {module}'` must work"
    )


class MathDatasetError(DatasetError):
    """A math dataset or the answer checker cannot be used: missing package or file, bad row."""


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_INTEGER = re.compile(r"-?\d{1,200}")
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_E_NOTATION = re.compile(r"(\d(?:\.\d*)?)[eE]([-+]?\d+)")  # Python's 1e-05, not latex's e
_BARE_PI = re.compile(r"(?<![\\A-Za-z])pi(?![A-Za-z])")


def extract_boxed(text: str) -> str | None:
    """The content of the last complete, non-empty ``\\boxed{...}`` (or ``\\fbox{...}``) of
    ``text``, braces balanced; ``None`` when there is none. Never raises; an opening without
    its closing brace within :data:`MAX_ANSWER_CHARS` (a completion cut short) is skipped."""
    if not isinstance(text, str):
        return None
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts[-MAX_BOXED_CANDIDATES:]):
        depth = 1
        for i in range(start, min(len(text), start + MAX_ANSWER_CHARS)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    content = without_surrogates(text[start:i]).strip()
                    if content:
                        return content
                    break
    return None


def verify(prediction: str, ground_truth: str, timeout_s: float = VERIFY_TIMEOUT_S) -> bool:
    """Whether ``prediction`` is mathematically equal to ``ground_truth`` (math-verify).

    Each side may be a plain number (``0.5``, ``1,000``, ``-3``), a fraction (``1/2``), LaTeX
    (``\\frac{\\sqrt{3}}{2}``, ``[0, 1)``), Python-style output (``3*sqrt(2)/2``, ``2**10``,
    ``1e-05``), wrapped in ``$...$`` or given as a text whose last ``\\boxed{}`` holds the
    answer. Never raises on any input: an unparseable, over-long (> :data:`MAX_ANSWER_CHARS`)
    or too slow (> ``timeout_s``) comparison is ``False``. Raises :class:`MathDatasetError` only
    when math-verify cannot run at all (not installed).
    """
    pred, truth = _normalise(prediction), _normalise(ground_truth)
    if pred is None or truth is None:
        return False
    if pred == truth:
        return True
    if _INTEGER.fullmatch(pred) and _INTEGER.fullmatch(truth):
        return int(pred) == int(truth)
    return _verifier_pool().check(_as_latex(pred), _as_latex(truth), timeout_s)


def _normalise(answer: object) -> str | None:
    if not isinstance(answer, str):
        return None
    text = answer
    if _BOXED.search(text):
        boxed = extract_boxed(text)
        if boxed is None:
            return None
        text = boxed
    text = without_surrogates(text).strip()
    for left, right in _DELIMITERS:
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : -len(right)].strip()
            break
    text = text.rstrip(".").strip()
    if not text or len(text) > MAX_ANSWER_CHARS:
        return None
    return text


def _as_latex(answer: str) -> str:
    """``answer`` as a boxed LaTeX expression that math-verify reads: Python's ``**``, ``pi``
    and ``1e-05`` become ``^``, ``\\pi`` and ``1\\times 10^{-05}`` (math-verify's plain-text
    parser reads ``3*sqrt(2)/2`` as 3; its LaTeX parser reads it right)."""
    text = answer.replace("**", "^")
    text = _E_NOTATION.sub(r"\1\\times 10^{\2}", text)
    text = _BARE_PI.sub(r"\\pi", text)
    return f"\\boxed{{{text}}}"


# The verifier process: reads [prediction, ground_truth] JSON lines, answers "1" or "0" per line.
# It is a source string run with `python -I -c` so that it imports neither atgrpo (which would
# import torch) nor anything from the current directory.
_VERIFIER_SOURCE = f"""
import json, logging, resource, sys
limit = {_VERIFIER_MEMORY_MB} * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
logging.disable(logging.CRITICAL)
from math_verify import parse, verify
from math_verify.errors import TimeoutException
print("ready", flush=True)
for line in sys.stdin:
    try:
        prediction, truth = json.loads(line)
        gold = parse(truth, parsing_timeout={_VERIFIER_STEP_TIMEOUT_S})
        target = parse(prediction, parsing_timeout={_VERIFIER_STEP_TIMEOUT_S})
        ok = bool(gold) and bool(target) and verify(
            gold, target, timeout_seconds={_VERIFIER_STEP_TIMEOUT_S}
        )
    except (Exception, TimeoutException):
        ok = False
    print(1 if ok else 0, flush=True)
"""


class _VerifierProcess:
    """One child process running math-verify; used by one thread at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-X", "utf8", "-c", _VERIFIER_SOURCE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={"PATH": os.environ.get("PATH", "")},  # no secrets for a parser of model text
        )
        if self._read_line(_VERIFIER_START_TIMEOUT_S) != b"ready\n":
            self.close()
            raise MathDatasetError(
                "the math-verify checker process did not start; "
                f"run `{sys.executable} -c 'import math_verify'` to see why"
            )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self, prediction: str, truth: str, timeout_s: float) -> bool:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps([prediction, truth]).encode("ascii") + b"\n")
            stdin.flush()
        except OSError:  # the process died (killed from outside)
            self.close()
            return False
        reply = self._read_line(timeout_s)
        if reply not in (b"0\n", b"1\n"):  # timed out, out of memory or dead: a failed check
            self.close()
            return False
        return reply == b"1\n"

    def _read_line(self, timeout_s: float) -> bytes:
        """One reply line, or b"" on timeout or end of file. Reads the raw descriptor, so no
        buffered read-ahead can hide a line from select()."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        data = b""
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return b""
            chunk = os.read(fd, 256)
            if not chunk:
                return b""
            data += chunk
        return data

    def close(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class _VerifierPool:
    """Verifier processes: a thread takes an idle one or starts one, up to
    :data:`_MAX_VERIFIER_PROCESSES` at a time."""

    def __init__(self) -> None:
        if importlib.util.find_spec("math_verify") is None:
            raise MathDatasetError(_missing("math-verify", "math_verify", "checking answers"))
        self._idle: list[_VerifierProcess] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(_MAX_VERIFIER_PROCESSES)
        atexit.register(self.close)

    def check(self, prediction: str, truth: str, timeout_s: float) -> bool:
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            worker = worker or _VerifierProcess()
            ok = worker.check(prediction, truth, timeout_s)
            if worker.alive:
                with self._lock:
                    self._idle.append(worker)
            return ok

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.close()


@functools.cache
def _verifier_pool() -> _VerifierPool:
    return _VerifierPool()
