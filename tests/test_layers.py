"""The package's layers (docs/design.md): imports run one way, from the faces down to the leaves.

Every import in src/atgrpo, top-level or inside a function, is read with ``ast``; each module
belongs to a unit (a top-level module or a subpackage), each unit to a layer of :data:`LAYERS`.
A unit may import its own modules and the units of lower layers, nothing above or beside it,
and no set of modules may import each other in a circle. Some units are entered only through
some of their modules (:data:`DOORS`, :data:`ENTERED_FROM`): the algorithm sees the rollout
engines through their contract alone, and the CPU decode engine is entered from the HF engine.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "src" / "atgrpo"

# Top to bottom; a unit imports only units of the layers below its own.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),  # python -m atgrpo
    ("cli",),  # the command line
    ("__init__",),  # the public API: `from atgrpo import ...`
    ("experiments",),  # comparisons: many runs, their tables and intervals
    ("api",),  # train / evaluate / load_checkpoint, the functions experiments drive
    ("training",),  # one run: loop, run folder, runtime, evaluation, metrics, trackers
    ("distributed",),  # Ray worker groups, FSDP2 sharding
    ("checkpoint", "policies"),  # the on-disk format; models + optimizers from the config
    ("config_docs",),  # the generated config reference
    ("config", "prompts"),  # the typed config tree; chat messages -> token ids
    ("algo",),  # the paper's algorithm: reads no Config
    ("envs", "generation"),  # environments; rollout engines
    ("data", "adapters", "report"),  # dataset loaders; the LoRA folder; the HTML report
    ("models",),  # finding, preparing and loading models
    ("sandbox", "parsing", "splits", "attention", "lazy"),  # leaves
)

# (unit, a unit below it) -> the only modules of the second the first may import: algo/ sees the
# rollout engines through their contract, so importing the algorithm loads no engine.
DOORS: dict[tuple[str, str], frozenset[str]] = {
    ("algo", "generation"): frozenset({"atgrpo.generation.base"}),
}
# A subpackage -> the only modules outside it that may import it: the CPU decode engine is
# entered from the HF engine alone.
ENTERED_FROM: dict[str, frozenset[str]] = {
    "atgrpo.generation.cpu": frozenset({"atgrpo.generation.hf"}),
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(name: str, root: Path) -> bool:
    return (root.parent / Path(*name.split(".")) / "__init__.py").is_file()


def _resolve(node: ast.ImportFrom, importer: str, is_init: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_init else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _targets(node: ast.AST, importer: str, is_init: bool, root: Path) -> Iterator[str]:
    """The atgrpo modules one import statement loads (``from pkg import mod`` names mod)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        module = _resolve(node, importer, is_init)
        for alias in node.names:
            sub = f"{module}.{alias.name}"
            is_module = (root.parent / f"{sub.replace('.', '/')}.py").is_file()
            # `from pkg import mod` loads mod; `from pkg import name` loads pkg's __init__.
            yield sub if is_module or _is_package(sub, root) else module


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the atgrpo modules it imports (every import statement, wherever it stands)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges = graph.setdefault(name, set())
        for node in ast.walk(tree):
            for target in _targets(node, name, path.name == "__init__.py", root):
                if target == "atgrpo" or target.startswith("atgrpo."):
                    edges.add(target)
        edges.discard(name)
    return graph


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_problems(root: Path) -> list[str]:
    """Every import that runs up or sideways, every module of no layer, every circle."""
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    graph = import_graph(root)
    problems = []
    for module, targets in sorted(graph.items()):
        unit = unit_of(module)
        if unit not in rank:
            problems.append(f"{module}: unit {unit!r} is in no layer of LAYERS")
            continue
        for target in sorted(targets):
            other = unit_of(target)
            if other != unit and rank.get(other, -1) <= rank[unit]:
                problems.append(f"{module} -> {target}: {unit!r} may not import {other!r}")
    problems.extend(door_problems(graph))
    problems.extend(f"circle: {' -> '.join(c)}" for c in circles(graph))
    return problems


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def door_problems(graph: dict[str, set[str]]) -> list[str]:
    """Every import that enters a unit or a subpackage other than through its doors."""
    problems = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            doors = DOORS.get((unit_of(module), unit_of(target)))
            if doors is not None and target not in doors:
                problems.append(
                    f"{module} -> {target}: {unit_of(module)!r} may import only "
                    f"{', '.join(sorted(doors))} of {unit_of(target)!r}"
                )
            for package, entries in ENTERED_FROM.items():
                entered = _within(target, package) and not _within(module, package)
                if entered and module not in entries:
                    problems.append(
                        f"{module} -> {target}: {package} is entered only from "
                        f"{', '.join(sorted(entries))}"
                    )
    return problems


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while (member := stack.pop()) != node:
                members.append(member)
            if members:
                found.append(sorted([node, *members]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_imports_only_down_its_layers_and_in_no_circle() -> None:
    assert layer_problems(PACKAGE) == []


def test_an_upward_import_and_a_circle_are_caught(tmp_path: Path) -> None:
    copy = tmp_path / "atgrpo"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    options = copy / "algo" / "options.py"
    options.write_text(options.read_text() + "\nfrom atgrpo.config import Config\n")
    assert layer_problems(copy) == [
        "atgrpo.algo.options -> atgrpo.config: 'algo' may not import 'config'",
        "circle: atgrpo.algo.options -> atgrpo.config",  # config imports the options' enums
    ]


def test_algo_sees_the_engines_only_through_their_contract() -> None:
    """The door rules on a synthetic import list: algo/ may take generation.base, not the
    package's face nor an engine; only the HF engine enters the CPU engine."""
    graph = {
        "atgrpo.algo.rollout": {"atgrpo.generation.base", "atgrpo.models"},  # allowed
        "atgrpo.algo.prefix": {"atgrpo.generation", "atgrpo.generation.hf"},
        "atgrpo.generation.hf": {"atgrpo.generation.cpu", "atgrpo.generation.sampler"},  # allowed
        "atgrpo.generation.cpu.engine": {"atgrpo.generation.cpu.fused"},  # inside: allowed
        "atgrpo.generation.vllm": {"atgrpo.generation.cpu.kernels"},
    }
    assert door_problems(graph) == [
        "atgrpo.algo.prefix -> atgrpo.generation: 'algo' may import only "
        "atgrpo.generation.base of 'generation'",
        "atgrpo.algo.prefix -> atgrpo.generation.hf: 'algo' may import only "
        "atgrpo.generation.base of 'generation'",
        "atgrpo.generation.vllm -> atgrpo.generation.cpu.kernels: atgrpo.generation.cpu is "
        "entered only from atgrpo.generation.hf",
    ]


def test_a_planted_import_of_the_cpu_engine_in_algo_is_caught(tmp_path: Path) -> None:
    copy = tmp_path / "atgrpo"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    loss = copy / "algo" / "loss.py"
    loss.write_text(loss.read_text() + "\nfrom atgrpo.generation.cpu import extension\n")
    before = set(layer_problems(PACKAGE))
    assert [problem for problem in layer_problems(copy) if problem not in before] == [
        "atgrpo.algo.loss -> atgrpo.generation.cpu: 'algo' may import only "
        "atgrpo.generation.base of 'generation'",
        "atgrpo.algo.loss -> atgrpo.generation.cpu: atgrpo.generation.cpu is entered only from "
        "atgrpo.generation.hf",
    ]


def test_importing_the_update_loads_no_module_of_the_cpu_engine() -> None:
    """``import atgrpo.algo.update`` in a fresh process: the algorithm's imports (and the
    package's face, which it runs first) load none of atgrpo.generation.cpu."""
    code = (
        "import sys, atgrpo.algo.update\n"
        "print(sorted(m for m in sys.modules if m.startswith('atgrpo.generation.cpu')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert done.stdout.strip() == "[]"


def test_a_module_outside_every_layer_is_named(tmp_path: Path) -> None:
    copy = tmp_path / "atgrpo"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "helpers.py").write_text("from atgrpo.parsing import extract_code\n")
    assert "atgrpo.helpers: unit 'helpers' is in no layer of LAYERS" in layer_problems(copy)
