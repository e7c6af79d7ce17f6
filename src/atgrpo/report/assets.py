"""The page's stylesheet and scripts, inlined into report.html (strings, so they ship with the
package without package-data rules). System fonts only: the page loads nothing."""

CSS = r"""
:root {
  --fg: #1d2430; --muted: #5f6b7a; --line: #d9dee5; --bg: #f6f7f9; --card: #fff;
  --kept: #1a7f37; --kept-bg: #eef8f0; --bad: #b42318; --good: #1a7f37; --accent: #1f5fbf;
}
* { box-sizing: border-box; }
body {
  margin: 0; background: var(--bg); color: var(--fg);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
}
header.top {
  background: #17202c; color: #fff; padding: 14px 28px 12px;
  display: flex; align-items: baseline; gap: 18px; flex-wrap: wrap;
}
header.top h1 { font-size: 20px; margin: 0; font-weight: 600; }
header.top .sub { color: #b8c2cf; font-size: 13px; }
header.top nav { margin-left: auto; display: flex; gap: 14px; }
header.top nav a { color: #cfe0ff; text-decoration: none; font-size: 13px; }
main { max-width: 1480px; margin: 0 auto; padding: 14px 28px 40px; }
h2 { font-size: 16px; margin: 22px 0 10px; }
table.summary, table.evals {
  border-collapse: collapse; background: var(--card); font-size: 13px; width: 100%;
}
table.summary th, table.summary td, table.evals th, table.evals td {
  border: 1px solid var(--line); padding: 5px 8px; text-align: left; vertical-align: top;
}
table.summary th, table.evals th { background: #eef1f5; font-weight: 600; }
table.summary td:first-child { white-space: nowrap; }
.swatch {
  display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 6px;
  vertical-align: -1px;
}
.notes { color: var(--muted); font-size: 13px; margin: 8px 0 0; padding-left: 18px; }
.curves {
  display: grid; gap: 12px; grid-template-columns: repeat(auto-fill, minmax(430px, 1fr));
}
figure {
  margin: 0; background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  padding: 6px;
}
figure img { width: 100%; height: auto; display: block; }
figcaption { color: var(--muted); font-size: 12px; padding: 2px 4px 0; min-height: 1em; }
details.config { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  margin-bottom: 8px; }
details.config > summary { padding: 7px 10px; cursor: pointer; font-weight: 600; }
details.config pre { margin: 0; padding: 8px 12px; border-top: 1px solid var(--line);
  max-height: 480px; overflow: auto; font-size: 12px; }
.viewer-bar {
  display: flex; gap: 14px; align-items: center; flex-wrap: wrap; background: var(--card);
  border: 1px solid var(--line); border-radius: 6px; padding: 8px 12px;
}
.viewer-bar label { font-weight: 600; font-size: 13px; }
.viewer-bar select { font: inherit; padding: 2px 4px; margin-left: 4px; }
.viewer-bar .info { color: var(--muted); font-size: 13px; }
.viewer-note { color: var(--muted); font-size: 12px; margin: 6px 2px; }
.tree { position: relative; margin-top: 10px; }
svg.links { position: absolute; left: 0; top: 0; pointer-events: none; overflow: visible; }
svg.links path { fill: none; stroke: #b9c2ce; stroke-width: 1.2; }
svg.links path.kept-path { stroke: var(--kept); stroke-width: 3; }
.node { position: relative; margin-bottom: 34px; }
.node-head { display: flex; gap: 10px; align-items: baseline; flex-wrap: wrap; margin: 0 0 6px; }
.agent {
  color: #fff; border-radius: 4px; padding: 1px 8px; font-weight: 600; font-size: 13px;
}
.node-head .meta { color: var(--muted); font-size: 12px; }
details.prompt { font-size: 12px; margin: 0 0 6px; }
details.prompt > summary { cursor: pointer; color: var(--accent); }
details.prompt pre { max-height: 320px; }
.branches { display: grid; gap: 10px; grid-template-columns: repeat(auto-fit, minmax(240px, 1fr)); }
.card {
  background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 7px 9px;
  position: relative; z-index: 1; min-width: 0;
}
.card.kept { border: 2px solid var(--kept); background: var(--kept-bg); }
.card-head { display: flex; gap: 6px; align-items: center; flex-wrap: wrap; font-size: 12px; }
.tag { border-radius: 3px; padding: 0 5px; font-size: 11px; font-weight: 600; }
.tag.kept { background: var(--kept); color: #fff; }
.tag.valid { background: #e3f1e6; color: var(--good); }
.tag.invalid { background: #fbe5e3; color: var(--bad); }
.card-head .from { color: var(--muted); margin-left: auto; }
.nums { display: flex; flex-wrap: wrap; gap: 2px 12px; margin: 5px 0; font-size: 12px; }
.nums span { white-space: nowrap; }
.nums .k { color: var(--muted); margin-right: 4px; }
.pos { color: var(--good); } .neg { color: var(--bad); }
pre {
  white-space: pre-wrap; word-break: break-word; background: #f3f5f8; border-radius: 4px;
  padding: 5px 7px; margin: 0; font: 12px/1.35 ui-monospace, "DejaVu Sans Mono", monospace;
}
pre.response { max-height: 13em; overflow: auto; }
.tokens { color: var(--muted); font-size: 11px; margin-top: 3px; }
.tag.cut { background: #fff1d6; color: #8a5300; }
.tag.tie { background: #e6eefb; color: var(--accent); }
.why { color: var(--bad); font-size: 12px; margin: 4px 0 2px; }
.program { margin-top: 5px; font-size: 12px; }
.program .k { color: var(--muted); margin-right: 4px; }
pre.output { max-height: 9em; overflow: auto; margin-top: 2px; }
pre.output.error { background: #fbeeed; }
details.info { font-size: 12px; margin-top: 4px; }
details.info > summary { cursor: pointer; color: var(--accent); }
.hash-note {
  background: #fff4e5; border: 1px solid #f0c36d; border-radius: 6px; padding: 6px 12px;
  margin-top: 8px; font-size: 13px;
}
.empty { color: var(--muted); padding: 16px; }
"""

# Registered in <head>, before anything else runs: errors of the viewer's script (a syntax
# error too) end up in <body data-errors>, which a headless browser's DOM dump shows.
ERRORS_JS = r"""
window.__reportErrors = [];
window.addEventListener("error", function (e) {
  window.__reportErrors.push(String(e.message || e.type));
  var target = document.body || document.documentElement;
  target.setAttribute("data-errors", window.__reportErrors.join(" | "));
});
"""

VIEWER_JS = r"""
(function () {
  "use strict";
  var PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
  var payload = JSON.parse(document.getElementById("rollouts").textContent);
  var runSel = document.getElementById("sel-run");
  var stepSel = document.getElementById("sel-step");
  var taskSel = document.getElementById("sel-task");
  var info = document.getElementById("task-info");
  var runNote = document.getElementById("run-note");
  var tree = document.getElementById("tree");
  var cards = {};  // "agent|turn|branch" -> card element of the rendered task
  var links = [];  // [child card, parent key, both kept]

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }
  function num(x) {
    if (x === null || x === undefined) { return "\u2013"; }
    return (x > 0 ? "+" : "") + x.toFixed(3);
  }
  function signClass(x) {
    if (x === null || x === undefined || x === 0) { return ""; }
    return x > 0 ? "pos" : "neg";
  }
  function keyOf(agent, turn, branch) { return agent + "|" + turn + "|" + branch; }
  function setOptions(sel, items) {
    sel.textContent = "";
    items.forEach(function (it) {
      var o = el("option", null, it[1]);
      o.value = String(it[0]);
      sel.appendChild(o);
    });
    sel.disabled = items.length === 0;
  }
  function pick(sel, want) {
    // Selects ``want`` when the list has it, else the first; false when ``want`` was missing.
    var values = Array.prototype.map.call(sel.options, function (o) { return o.value; });
    if (want !== undefined && values.indexOf(String(want)) >= 0) {
      sel.value = String(want);
      return true;
    }
    if (values.length) { sel.value = values[0]; }
    return want === undefined;
  }

  function run() { return payload.runs[Number(runSel.value)] || null; }
  function step() {
    var r = run();
    if (!r) { return null; }
    var s = Number(stepSel.value);
    return r.steps.filter(function (x) { return x.step === s; })[0] || null;
  }
  function task() {
    var s = step();
    if (!s) { return null; }
    var t = Number(taskSel.value);
    return s.tasks.filter(function (x) { return x.task_id === t; })[0] || null;
  }

  function fillSteps(want) {
    var r = run();
    setOptions(stepSel, r ? r.steps.map(function (s) { return [s.step, "step " + s.step]; }) : []);
    return pick(stepSel, want);
  }
  function fillTasks(want) {
    var s = step();
    setOptions(taskSel, s ? s.tasks.map(function (t) {
      return [t.task_id, "task " + t.task_id + (t.seed === null ? "" : " (seed " + t.seed + ")")];
    }) : []);
    return pick(taskSel, want);
  }

  function groupText(g) {
    if (!g) { return ""; }
    return "group: " + [
      g[0] === null ? "all tasks" : "task " + g[0],
      g[1] === null ? "all agents" : g[1],
      g[2] === null ? "all turns" : "turn " + g[2],
    ].join(" \u00b7 ");
  }

  function promptBlock(text, tokens, label) {
    var d = el("details", "prompt");
    var tok = tokens === null || tokens === undefined ? "" : " (" + tokens + " tokens)";
    d.appendChild(el("summary", null, label + tok));
    d.appendChild(el("pre", null, text));
    return d;
  }

  function numsRow(b) {
    var row = el("div", "nums");
    [["team", b.team_reward], ["local", b.local_reward], ["mixed", b.reward], ["adv", b.advantage]]
      .forEach(function (kv) {
        var pair = el("span");
        pair.appendChild(el("span", "k", kv[0]));
        pair.appendChild(el("span", kv[0] === "adv" ? signClass(kv[1]) : "", num(kv[1])));
        row.appendChild(pair);
      });
    return row;
  }

  function tieText(node) {
    return "branches " + node.tie.map(function (i) { return "#" + i; }).join(", ") +
      " share the best reward; the rollout keeps the first of equals";
  }

  function infoBlocks(c, info) {
    // What the env said about the action: why it was invalid, the tool program's output.
    if (!info) { return; }
    if (info.parse_error) { c.appendChild(el("div", "why", "invalid: " + info.parse_error)); }
    if ("program_status" in info) {
      var prog = el("div", "program");
      prog.appendChild(el("span", "k", "program"));
      prog.appendChild(el("b", null, info.program_status));
      var out = info.stdout === undefined || info.stdout === null ? null : String(info.stdout);
      prog.appendChild(el("pre", "output", out === "" ? "(printed nothing)"
        : out === null ? "(output not logged)" : out));
      ["error", "stderr"].forEach(function (k) {
        if (info[k]) { prog.appendChild(el("pre", "output error", info[k])); }
      });
      c.appendChild(prog);
    }
    if ("game_messages" in info) {
      // A game's own words on the move (TextArena): accepted, invalid and why, the showdown.
      var game = el("div", "game");
      game.appendChild(el("span", "k", info.invalid_move ? "game (invalid move)" : "game"));
      game.appendChild(el("pre", "output", info.game_messages || "(the game said nothing)"));
      c.appendChild(game);
    }
    var shown = ["parse_error", "program_status", "stdout", "error", "stderr", "game_messages"];
    var rest = Object.keys(info).filter(function (k) { return shown.indexOf(k) < 0; });
    if (rest.length) {
      var d = el("details", "info");
      d.appendChild(el("summary", null, "env info"));
      d.appendChild(el("pre", null, rest.map(function (k) {
        return k + ": " + (info[k] === null ? "null" : String(info[k]));
      }).join("\n")));
      c.appendChild(d);
    }
  }

  function card(node, b) {
    var c = el("article", "card" + (b.kept ? " kept" : ""));
    c.dataset.branch = String(b.branch_idx);
    var head = el("div", "card-head");
    head.appendChild(el("b", null, "#" + b.branch_idx));
    if (b.kept) { head.appendChild(el("span", "tag kept", "kept")); }
    if (b.kept && node.tie) {
      var tie = el("span", "tag tie", "tie-break");
      tie.title = tieText(node);
      head.appendChild(tie);
    }
    if (b.valid !== null) {
      var word = b.valid ? "valid" : "invalid";
      head.appendChild(el("span", "tag " + word, word));
    }
    if (b.truncated) {
      var cut = el("span", "tag cut", "cut");
      cut.title = "cut at max_new_tokens: no end-of-sequence token";
      head.appendChild(cut);
    }
    if (b.parent) {
      var from = "\u2190 " + b.parent[0] + " t" + b.parent[1] + " #" + b.parent[2];
      head.appendChild(el("span", "from", from));
    }
    c.appendChild(head);
    c.appendChild(numsRow(b));
    if (b.prompt !== undefined) {
      c.appendChild(b.prompt === null ? el("div", "tokens", "prompt not logged")
        : promptBlock(b.prompt, b.prompt_tokens, "prompt"));
    }
    c.appendChild(el("pre", "response", b.response === "" ? "(empty response)" : b.response));
    if (b.response_tokens !== null) {
      var tokens = b.response_tokens + " response tokens";
      c.appendChild(el("div", "tokens", tokens + (b.truncated ? ", cut at max_new_tokens" : "")));
    }
    infoBlocks(c, b.info);
    cards[keyOf(node.agent_id, node.turn_idx, b.branch_idx)] = c;
    if (b.parent) { links.push([c, keyOf(b.parent[0], b.parent[1], b.parent[2]), b.kept]); }
    return c;
  }

  function nodeSection(node, color) {
    var sec = el("section", "node");
    sec.dataset.agent = node.agent_id;
    sec.dataset.turn = String(node.turn_idx);
    var head = el("div", "node-head");
    var badge = el("span", "agent", node.agent_id);
    badge.style.background = color;
    head.appendChild(badge);
    head.appendChild(el("b", null, "turn " + node.turn_idx));
    var meta = ["K = " + node.branches.length];
    if (node.policy_id) { meta.push("policy " + node.policy_id); }
    if (node.reward_mean !== null) { meta.push("group mean reward " + num(node.reward_mean)); }
    if (node.group) { meta.push(groupText(node.group)); }
    if (node.truncated) {
      meta.push(node.truncated + " of " + node.branches.length + " cut at max_new_tokens");
    }
    if (node.tie) { meta.push("kept by tie-break: " + tieText(node)); }
    head.appendChild(el("span", "meta", meta.join(" \u00b7 ")));
    sec.appendChild(head);
    if (node.prompt !== null) {
      var first = node.branches[0] || {};
      var label = "prompt, shared by the K branches";
      sec.appendChild(promptBlock(node.prompt, first.prompt_tokens, label));
    } else if (node.branches.every(function (b) { return b.prompt === undefined; })) {
      sec.appendChild(el("div", "tokens", "prompt not logged (older samples.jsonl)"));
    }
    var row = el("div", "branches");
    node.branches.forEach(function (b) { row.appendChild(card(node, b)); });
    sec.appendChild(row);
    return sec;
  }

  function drawLinks() {
    var old = tree.querySelector("svg.links");
    if (old) { old.remove(); }
    var base = tree.getBoundingClientRect();
    var paths = links.map(function (l) {
      var parent = cards[l[1]];
      if (!parent) { return ""; }
      var p = parent.getBoundingClientRect(), c = l[0].getBoundingClientRect();
      var x1 = p.left + p.width / 2 - base.left, y1 = p.bottom - base.top;
      var x2 = c.left + c.width / 2 - base.left, y2 = c.top - base.top;
      var mid = (y1 + y2) / 2;
      var d = "M" + x1 + "," + y1 + " C" + x1 + "," + mid + " " + x2 + "," + mid + " " +
        x2 + "," + y2;
      var kept = l[2] && parent.classList.contains("kept");
      return '<path d="' + d + '"' + (kept ? ' class="kept-path"' : "") + "></path>";
    });
    // Parsed as HTML, <svg> lands in the SVG namespace: no namespace name is needed.
    tree.insertAdjacentHTML("afterbegin", '<svg class="links" width="' + tree.scrollWidth +
      '" height="' + tree.scrollHeight + '">' + paths.join("") + "</svg>");
  }

  function render() {
    var r = run(), s = step(), t = task();
    tree.textContent = "";
    cards = {};
    links = [];
    runNote.textContent = r ? runText(r) : "";
    tree.dataset.run = r ? r.name : "";
    tree.dataset.step = s ? String(s.step) : "";
    tree.dataset.task = t ? String(t.task_id) : "";
    if (!t) {
      var why = "No samples logged for this run (run.log_samples = 0?).";
      tree.appendChild(el("div", "empty", why));
      info.textContent = "";
      return;
    }
    var bits = ["seed " + t.seed];
    if (t.instance_key) { bits.push("instance " + t.instance_key); }
    if (t.final_team_reward !== null) {
      bits.push("team reward at the end of the kept path " + num(t.final_team_reward));
    }
    info.textContent = bits.join(" \u00b7 ");
    t.nodes.forEach(function (node) {
      var color = PALETTE[Math.max(0, r.agents.indexOf(node.agent_id)) % PALETTE.length];
      tree.appendChild(nodeSection(node, color));
    });
    tree.dataset.nodes = String(t.nodes.length);
    drawLinks();
  }

  function runText(r) {
    var text = r.steps.length + " of " + r.logged_steps + " logged steps embedded.";
    if (r.schema < 1) {
      text += " Older samples.jsonl: prompts, policies and parent links were not logged; the " +
        "tree follows the kept branch of each action in turn and agent order.";
    }
    return text;
  }

  function writeHash() {
    var r = run();
    var h = "#run=" + encodeURIComponent(r ? r.name : "") + "&step=" + stepSel.value +
      "&task=" + taskSel.value;
    try { history.replaceState(null, "", h); } catch (e) { /* some file:// contexts refuse */ }
  }

  function runIndex(key) {
    // A run's name, else its position in the page (the select's value).
    var byName = payload.runs.findIndex(function (r) { return r.name === key; });
    return byName >= 0 ? byName : key;
  }

  function show(runIdx, stepNo, taskNo) {
    // What it was asked for and the page lacks, e.g. ["step 7"]; the first is shown instead.
    var missing = [];
    if (!pick(runSel, runIdx)) { missing.push('run "' + runIdx + '"'); }
    if (!fillSteps(stepNo)) { missing.push("step " + stepNo); }
    if (!fillTasks(taskNo)) { missing.push("task " + taskNo); }
    render();
    return missing;
  }

  function hashNote(missing) {
    var note = document.getElementById("hash-note");
    tree.dataset.missing = missing.join(", ");
    note.hidden = missing.length === 0;
    if (!missing.length) { note.textContent = ""; return; }
    var s = step(), t = task();
    var now = [run() ? run().name : "", s ? "step " + s.step : "", t ? "task " + t.task_id : ""];
    note.textContent = "The address asks for " + missing.join(" and ") + ", which this " +
      "report does not hold; showing " + now.filter(Boolean).join(", ") + " instead.";
  }

  function fromHash() {
    var params = {};
    location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
      var i = kv.indexOf("=");
      if (i > 0) { params[kv.slice(0, i)] = decodeURIComponent(kv.slice(i + 1)); }
    });
    if (!("run" in params || "step" in params || "task" in params)) { return false; }
    hashNote(show(runIndex(params.run), params.step, params.task));
    return true;
  }

  setOptions(runSel, payload.runs.map(function (r, i) { return [i, r.name]; }));
  runSel.addEventListener("change", function () {
    show(runSel.value, stepSel.value, taskSel.value);
    hashNote([]);
    writeHash();
  });
  stepSel.addEventListener("change", function () {
    fillTasks(taskSel.value);
    render();
    hashNote([]);
    writeHash();
  });
  taskSel.addEventListener("change", function () { render(); hashNote([]); writeHash(); });
  window.addEventListener("resize", drawLinks);
  tree.addEventListener("toggle", drawLinks, true);  // a prompt opened: cards moved
  window.addEventListener("hashchange", fromHash);
  // From the console: atgrpoShow(run name or index, step, task).
  window.atgrpoShow = function (r, s, t) { show(runIndex(r), s, t); };
  if (!fromHash()) { show(0); }
  document.body.dataset.ready = "1";
})();
"""
