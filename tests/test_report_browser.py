"""Headless Chromium opens the run report: no JavaScript error, the viewer switches, a picture.

Tier ``browser`` (``make test-browser``, which installs Debian's ``chromium``). The page's own
script records errors in ``<body data-errors>`` and sets ``data-ready="1"`` when it finished;
``--dump-dom`` prints the DOM after the script ran, and a URL fragment like
``#step=2&task=1`` selects what the viewer shows at load.

The README's picture is taken from a report the same way:
``.venv/bin/python tests/test_report_browser.py REPORT.html docs/report.png [#step=N&task=T]``.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from atgrpo.config import load_config
from atgrpo.report import write_report
from atgrpo.training.loop import train

REPO = Path(__file__).resolve().parents[1]
SIZE = (1400, 900)

pytestmark = pytest.mark.browser


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


def _chromium(args: list[str]) -> subprocess.CompletedProcess[str]:
    exe = find_chromium()
    if exe is None:
        pytest.skip("no chromium on PATH (make test-browser installs it)")
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                exe,
                "--headless",
                "--no-sandbox",  # as root (CI containers) Chromium refuses its sandbox
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                "--allow-file-access-from-files",
                f"--user-data-dir={profile}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )


def dump_dom(page: Path, fragment: str = "") -> str:
    return _chromium(["--virtual-time-budget=5000", "--dump-dom", page.as_uri() + fragment]).stdout


def screenshot(page: Path, out: Path, fragment: str = "", size: tuple[int, int] = SIZE) -> Path:
    """A picture of the page; taken until two in a row agree.

    Headless Chromium now and then captures before every tile is painted (a card cut off at
    a tile edge); such a picture rarely repeats itself exactly, a complete one always does.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = b""
    for _ in range(5):
        shot = _capture(page.as_uri() + fragment, size)
        if shot == previous:
            break
        previous = shot
    out.write_bytes(previous)
    return out


def _capture(url: str, size: tuple[int, int]) -> bytes:
    with tempfile.TemporaryDirectory() as folder:
        png = Path(folder) / "shot.png"
        w, h = size
        _chromium(
            ["--virtual-time-budget=3000", f"--window-size={w},{h}", f"--screenshot={png}", url]
        )
        return png.read_bytes()


_VOID = {"area", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}


class _Dom(HTMLParser):
    """The attributes of <body> and of the viewer's tree; the classes of every element; the
    text inside elements of each class (``texts``) and id (``by_id``), from the rendered DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.body: dict[str, str | None] = {}
        self.tree: dict[str, str | None] = {}
        self.classes: list[str] = []
        self.texts: dict[str, list[str]] = {}
        self.by_id: dict[str, dict[str, str | None]] = {}
        self._open: list[tuple[str, str]] = []  # (tag, class) of the elements the text is in

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if a.get("id") == "tree":
            self.tree = a
        if a.get("id"):
            self.by_id[a["id"] or ""] = a
        self.classes.append(a.get("class") or "")
        if tag not in _VOID:
            self._open.append((tag, a.get("class") or (f"#{a['id']}" if a.get("id") else "")))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == tag:
                del self._open[i:]
                break

    def handle_data(self, data: str) -> None:
        for _, cls in self._open:
            if cls:
                self.texts.setdefault(cls, []).append(data)

    def text(self, cls: str) -> str:
        return "".join(self.texts.get(cls, []))


def _parse(html: str) -> _Dom:
    dom = _Dom()
    dom.feed(html)
    return dom


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_report import _write_run
    from test_report_fields import write_fields_run

    runs = tmp_path_factory.mktemp("runs")
    cfg = load_config(
        REPO / "configs/tiny.yaml", [f"run.output_dir={runs}", "run.name=a", "train.steps=2"]
    )
    tiny = train(cfg).run_dir
    new = _write_run(runs, "new", schema=1)
    old = _write_run(runs, "old", schema=0)
    fields = write_fields_run(runs, "fields")  # tool output, cut answers, a tie, eval files
    game = load_config(
        REPO / "configs/textarena/kuhn-selfplay-tiny.yaml",
        [
            *(f"run.output_dir={runs}", "run.name=game", "train.steps=1"),
            *("env.train_opponent=random", "env.train_opponent_share=1"),  # a seat is random's
        ],
    )
    kuhn = train(game).run_dir  # TextArena's Kuhn Poker: the game's own messages on each move
    runs_ = [tiny, new, old, fields, kuhn]
    return write_report(runs_, tmp_path_factory.mktemp("page") / "report.html")


def _ready(html: str) -> _Dom:
    dom = _parse(html)
    assert dom.body.get("data-errors") == "", dom.body.get("data-errors")
    assert dom.body.get("data-ready") == "1"
    return dom


def test_the_page_runs_without_errors_and_shows_the_first_rollout(report: Path) -> None:
    dom = _ready(dump_dom(report))
    assert dom.tree["data-run"] == "a"
    assert (dom.tree["data-step"], dom.tree["data-task"]) == ("1", "0")
    nodes = int(dom.tree["data-nodes"] or 0)
    assert nodes == 4  # tiny: two turns of tool then planner
    assert dom.classes.count("card kept") == nodes  # one kept branch per (agent, turn)
    assert "kept-path" in dom.classes  # the kept path is drawn through the parent links


def test_a_fragment_selects_another_step_and_task(report: Path) -> None:
    dom = _ready(dump_dom(report, "#step=2&task=1"))
    assert (dom.tree["data-run"], dom.tree["data-step"], dom.tree["data-task"]) == ("a", "2", "1")
    dom = _ready(dump_dom(report, "#run=new&step=3&task=1"))
    assert (dom.tree["data-run"], dom.tree["data-step"], dom.tree["data-task"]) == ("new", "3", "1")
    assert "prompt" in dom.classes  # the newer schema logs prompts: collapsible blocks
    dom = _ready(dump_dom(report, "#run=old&step=2&task=0"))
    assert dom.tree["data-run"] == "old" and dom.classes.count("card kept") == 4


def test_tool_cards_show_the_program_output_cut_answers_and_the_tie_break(report: Path) -> None:
    from test_report_fields import STDOUT

    dom = _ready(dump_dom(report, "#run=fields&step=1&task=0"))
    assert dom.tree["data-run"] == "fields" and dom.tree["data-missing"] == ""
    assert STDOUT in dom.text("output")  # what the kept tool program printed
    assert "ZeroDivision" in dom.text("output error")  # the failed one's error
    assert "invalid: program failed (error)" in dom.text("why")
    assert "invalid: no \\boxed{} answer" in dom.text("why")  # why the reasoner's was invalid
    assert dom.text("tag cut") == "cut"  # one tool answer cut at max_new_tokens
    assert dom.text("tag tie") == "tie-break"  # the tool's kept branch won a tie
    assert "1 of 3 cut at max_new_tokens" in dom.text("meta")


def test_game_cards_show_each_moves_game_messages(report: Path) -> None:
    dom = _ready(dump_dom(report, "#run=game&step=1&task=0"))
    assert dom.tree["data-run"] == "game" and dom.tree["data-missing"] == ""
    said = dom.text("output")  # TextArena's words on the moves: the tiny model's are invalid
    assert "attempted an invalid move" in said, said[:300]
    assert "game (invalid move)" in dom.text("k")
    info = dom.text("info")  # the random player's seat (a record, as JSON)
    assert 'train_opponent: {"player_' in info and '": "random"}' in info, info[:300]


def test_the_summary_fills_before_after_from_the_eval_files(report: Path) -> None:
    dom = _ready(dump_dom(report))
    summary = dom.text("summary")
    assert "25.0% \u2192 62.5% (atgrpo eval: untrained, step 2)" in summary
    assert "tool 42% \u00b7 reasoner 0%" in summary  # answers cut at max_new_tokens, per agent


def test_an_unknown_step_or_task_in_the_address_says_so(report: Path) -> None:
    dom = _ready(dump_dom(report))
    assert dom.by_id["hash-note"].get("hidden") is not None  # nothing to say
    dom = _ready(dump_dom(report, "#run=fields&step=99&task=5"))
    assert dom.tree["data-missing"] == "step 99, task 5"
    assert dom.by_id["hash-note"].get("hidden") is None
    note = dom.text("hash-note")
    assert "step 99 and task 5" in note and "showing fields, step 1, task 0" in note
    dom = _ready(dump_dom(report, "#run=nosuch&step=1"))
    assert dom.tree["data-missing"] == 'run "nosuch"'
    assert "does not hold" in dom.text("hash-note")


def test_an_error_in_the_page_would_be_seen(report: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.html"
    text = report.read_text(encoding="utf-8")
    broken.write_text(text.replace("</main>", "</main><script>null.boom();</script>", 1))
    dom = _parse(dump_dom(broken))
    assert dom.body.get("data-errors"), "the error recorder missed a TypeError"


def test_a_screenshot_of_the_report(report: Path, tmp_path: Path) -> None:
    png = screenshot(report, tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == SIZE


if __name__ == "__main__":  # python tests/test_report_browser.py REPORT.html OUT.png [#FRAGMENT]
    fragment = sys.argv[3] if len(sys.argv) > 3 else ""
    print(screenshot(Path(sys.argv[1]).resolve(), Path(sys.argv[2]), fragment))
