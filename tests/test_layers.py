"""The layer rule of docs/architecture.md §8, enforced: every `step35/**/*.py` is parsed with `ast` (imports
at any depth, function-local and TYPE_CHECKING ones included), each file is mapped to its layer, and the
test fails on an import from a higher layer, an import that the rules within a layer forbid (data/ is a
leaf; APART), or a circle of imports between files or between packages.

Edges are file to file: `from step35.parallel import ParallelDims` points at step35/parallel/__init__.py,
`from step35.parallel.mesh import X` at step35/parallel/mesh.py (the package __init__ that Python runs on
the way is not counted as imported: otherwise every package would be a circle with its own files).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first; a file may import its own layer and those below. The longest matching prefix wins.
LAYERS: dict[str, int] = {
    "step35/__init__.py": 1,
    "step35/config.py": 1,
    "step35/presets.py": 1,
    "step35/faults.py": 1,
    "step35/job.py": 1,
    "step35/schedule.py": 1,
    "step35/data/": 1,
    "step35/kernels/": 2,
    "step35/accelerators.py": 2,
    "step35/flops.py": 2,
    "step35/model/": 3,
    "step35/parallel/": 4,
    "step35/checkpoint/": 4,
    "step35/balancing.py": 4,
    "step35/run/": 5,
    "step35/training/": 5,
    "step35/eval/": 5,
    "step35/module.py": 6,
    "step35/lightning_private.py": 6,
    "step35/strategy.py": 6,
    "step35/callbacks/": 6,
    "step35/loggers.py": 6,
    "step35/cli.py": 7,
    "step35/__main__.py": 7,
    "step35/commands/": 7,
    "step35/plan/": 7,
}

# Parts that import nothing of step35 outside themselves, whatever their layer allows.
LEAVES = ("step35/data/",)

# The common part of checkpoint/, at its top: what both of its sides (hf/, training/) use.
CHECKPOINT_COMMON = ("__init__.py", "errors.py", "integrity.py", "publish.py", "safe_load.py")

# Imports within a layer that go the wrong way: importer prefix -> prefixes it must not import.
APART: dict[str, tuple[str, ...]] = {
    "step35/parallel/": ("step35/checkpoint/",),  # checkpoint/ may use the mesh arithmetic, not the reverse
    "step35/training/": ("step35/run/",),  # run/ asks the optimizer and objective rooms what a resume may change
    # Callbacks read the module's state; the module and the strategy talk through Lightning and one
    # declared call (the strategy asks module.num_routed_experts()), never by importing each other.
    "step35/module.py": ("step35/callbacks/", "step35/strategy.py"),
    "step35/strategy.py": ("step35/callbacks/", "step35/module.py"),
    # Lightning training checkpoints (training/) may use HF folders (hf/) and the common part; hf/ never
    # imports training/, and the common part imports neither side.
    "step35/checkpoint/hf/": ("step35/checkpoint/training/",),
    **{
        f"step35/checkpoint/{name}": ("step35/checkpoint/hf/", "step35/checkpoint/training/")
        for name in CHECKPOINT_COMMON
    },
}

# Today's breaks, each fixed by another change now under way; the list only shrinks (a fixed edge left
# here fails the test too, so it is removed with its fix).
KNOWN_BREAKS: set[str] = set()


# ----------------------------------------------------------------------------------------- the checker
def layer_of(path: str, layers: dict[str, int]) -> int | None:
    """The layer of a file (path relative to the root, '/'-separated): its longest matching prefix."""
    matches = [prefix for prefix in layers if path == prefix or (prefix.endswith("/") and path.startswith(prefix))]
    return layers[max(matches, key=len)] if matches else None


def _module_file(root: Path, dotted: str) -> str | None:
    """step35.a.b -> 'step35/a/b.py' or 'step35/a/b/__init__.py', whichever exists."""
    base = dotted.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if (root / candidate).is_file():
            return candidate
    return None


def imported_files(root: Path, path: str, package: str = "step35") -> set[str]:
    """Files of `package` that the file at `path` imports, anywhere in it."""
    tree = ast.parse((root / path).read_text(), filename=path)
    parts = path[:-3].split("/")
    here = parts[:-1]  # the package the file is in (for __init__.py too)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from p import name`: the submodule p.name when there is one, else p itself.
            names = [
                f"{stem}.{alias.name}" if _module_file(root, f"{stem}.{alias.name}") else stem for alias in node.names
            ]
        else:
            continue
        for name in names:
            if name != package and not name.startswith(package + "."):
                continue
            # `import step35.a.b.c` where c is a name, not a file: the nearest module that is a file.
            while name and _module_file(root, name) is None:
                name = name.rpartition(".")[0]
            target = _module_file(root, name) if name else None
            if target and target != path:
                out.add(target)
    return out


def import_graph(root: Path, package: str = "step35") -> dict[str, set[str]]:
    files = sorted(p.relative_to(root).as_posix() for p in (root / package).rglob("*.py"))
    return {f: imported_files(root, f, package) for f in files}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one file (Tarjan), each sorted; a file importing itself is ignored."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of files (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit_of(path: str) -> str:
    """The package a file belongs to for the circle check between packages: step35/<pkg>/ or a top-level file."""
    parts = path.split("/")
    return "/".join(parts[:2]) + "/" if len(parts) > 2 else path


def breaks(
    graph: dict[str, set[str]],
    layers: dict[str, int],
    leaves: tuple[str, ...] = (),
    apart: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, str]:
    """Every edge that breaks the rule, written 'a -> b', with the reason: an import of a higher layer,
    out of a leaf, against `apart`, or on a circle between files or between packages (the edges of one
    shortest circle per strongly connected set are named)."""
    found: dict[str, str] = {}
    for prefix, banned in (apart or {}).items():
        for source, targets in graph.items():
            if source.startswith(prefix):
                for target in sorted(t for t in targets if t.startswith(banned)):
                    found[f"{source} -> {target}"] = f"{prefix} must not import {target}"
    for source, targets in graph.items():
        src_layer = layer_of(source, layers)
        if src_layer is None:
            found[f"{source} -> (any)"] = "the file has no layer: add it to LAYERS and docs/architecture.md"
            continue
        leaf = next((p for p in leaves if source.startswith(p)), None)
        for target in targets:
            dst_layer = layer_of(target, layers)
            if dst_layer is not None and dst_layer > src_layer:
                found[f"{source} -> {target}"] = f"layer {src_layer} imports layer {dst_layer}"
            elif leaf and not target.startswith(leaf):
                found[f"{source} -> {target}"] = f"{leaf} is a leaf: it imports nothing else of step35"
    for component in circles(graph):
        cycle = shortest_cycle(graph, component)
        for source, target in zip(cycle, cycle[1:] + cycle[:1]):
            found.setdefault(f"{source} -> {target}", "in a circle of imports: " + " -> ".join(cycle + cycle[:1]))
    units: dict[str, set[str]] = {}
    for source, targets in graph.items():
        units.setdefault(unit_of(source), set()).update(unit_of(t) for t in targets if unit_of(t) != unit_of(source))
    for component in circles(units):
        cycle = shortest_cycle(units, component)
        why = "in a circle of packages: " + " -> ".join(cycle + cycle[:1])
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            for source, targets in graph.items():
                if unit_of(source) == a:
                    for target in sorted(t for t in targets if unit_of(t) == b):
                        found.setdefault(f"{source} -> {target}", why)
    return found


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest circle through the files of a strongly connected set (the first by name among
    equals): the edges to name, rather than every edge of the set."""
    members = set(component)
    best: list[str] | None = None
    for start in component:
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        closing = [v for v in frontier if start in graph[v]]
        if closing:
            cycle = paths[min(closing)]
            if best is None or len(cycle) < len(best):
                best = cycle
    assert best is not None, component
    return best


# ----------------------------------------------------------------------------------------- the rule
def test_every_file_keeps_the_layer_rule():
    found = breaks(import_graph(ROOT), LAYERS, LEAVES, APART)
    new = {edge: why for edge, why in found.items() if edge not in KNOWN_BREAKS}
    assert not new, "imports that break docs/architecture.md §8:\n" + "\n".join(
        f"  {e}  ({w})" for e, w in sorted(new.items())
    )
    fixed = sorted(KNOWN_BREAKS - set(found))
    assert not fixed, f"fixed, so remove from KNOWN_BREAKS: {fixed}"


def test_every_layer_prefix_names_something():
    # A renamed package would otherwise leave its rule behind, matching nothing.
    missing = [p for p in LAYERS if not (ROOT / p).exists()]
    assert not missing, missing


# ----------------------------------------------------------------------------------------- the checker's own test
def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


FAKE_LAYERS = {"pkg/__init__.py": 1, "pkg/low/": 1, "pkg/mid.py": 2, "pkg/top/": 3}


def test_checker_accepts_a_clean_tree(tmp_path):
    _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "from pkg.low.a import f\n",
            "pkg/low/a.py": "import os\n",
            "pkg/mid.py": "from pkg.low import f\nimport pkg.low.a\n",
            "pkg/top/__init__.py": "",
            "pkg/top/cmd.py": "def main():\n    from . import other\n    from ..mid import g\n",
            "pkg/top/other.py": "from pkg.mid import g\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg/top/cmd.py"] == {"pkg/top/other.py", "pkg/mid.py"}  # function-local and relative
    assert graph["pkg/mid.py"] == {"pkg/low/__init__.py", "pkg/low/a.py"}
    assert breaks(graph, FAKE_LAYERS, ("pkg/low/",)) == {}


def test_checker_finds_a_back_edge_a_leaf_break_and_a_circle(tmp_path):
    _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "def f():\n    if True:\n        from pkg.mid import g  # back-edge, hidden in a function\n",
            "pkg/mid.py": "from pkg.low import a\n",
            "pkg/top/__init__.py": "",
            "pkg/top/x.py": "from .y import h\n",
            "pkg/top/y.py": "import pkg.top.z\n",
            "pkg/top/z.py": "from pkg.top import x\n",
        },
    )
    found = breaks(import_graph(tmp_path, "pkg"), FAKE_LAYERS, ("pkg/low/",))
    assert found["pkg/low/a.py -> pkg/mid.py"] == "layer 1 imports layer 2"
    # a -> mid -> a is a circle too; x -> y -> z -> x is one within a layer.
    assert "circle" in found["pkg/mid.py -> pkg/low/a.py"]
    for edge in ("pkg/top/x.py -> pkg/top/y.py", "pkg/top/y.py -> pkg/top/z.py", "pkg/top/z.py -> pkg/top/x.py"):
        assert found[edge] == "in a circle of imports: pkg/top/x.py -> pkg/top/y.py -> pkg/top/z.py -> pkg/top/x.py"
    assert len(found) == 5, found


def test_checker_holds_leaves_to_themselves(tmp_path):
    _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "from pkg import other\n",  # same layer, but outside the leaf
            "pkg/other.py": "",
        },
    )
    layers = {**FAKE_LAYERS, "pkg/other.py": 1}
    found = breaks(import_graph(tmp_path, "pkg"), layers, ("pkg/low/",))
    assert list(found) == ["pkg/low/a.py -> pkg/other.py"] and "leaf" in found["pkg/low/a.py -> pkg/other.py"]
    assert breaks(import_graph(tmp_path, "pkg"), layers) == {}


def test_checker_names_a_file_without_a_layer(tmp_path):
    _tree(tmp_path, {"pkg/__init__.py": "", "pkg/stray.py": ""})
    assert list(breaks(import_graph(tmp_path, "pkg"), {"pkg/__init__.py": 1})) == ["pkg/stray.py -> (any)"]


@pytest.mark.parametrize(
    "path, layer",
    [("step35/data/stream.py", 1), ("step35/model/moe.py", 3), ("step35/plan/cli.py", 7), ("step35/config.py", 1)],
)
def test_layer_of_takes_the_longest_prefix(path, layer):
    assert layer_of(path, LAYERS) == layer


def test_checker_finds_a_circle_between_packages_and_a_banned_import(tmp_path):
    # No file imports itself back, but pkg/top/ and pkg/side/ import each other: a circle of packages.
    _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/top/__init__.py": "",
            "pkg/top/a.py": "from pkg.side.b import f\n",
            "pkg/top/d.py": "",
            "pkg/side/__init__.py": "",
            "pkg/side/b.py": "",
            "pkg/side/c.py": "from pkg.top import d\nfrom pkg import mid\n",
            "pkg/mid.py": "",
        },
    )
    layers = {"pkg/__init__.py": 1, "pkg/mid.py": 1, "pkg/top/": 3, "pkg/side/": 3}
    graph = import_graph(tmp_path, "pkg")
    assert circles(graph) == []
    found = breaks(graph, layers)
    assert found == {
        "pkg/side/c.py -> pkg/top/d.py": "in a circle of packages: pkg/side/ -> pkg/top/ -> pkg/side/",
        "pkg/top/a.py -> pkg/side/b.py": "in a circle of packages: pkg/side/ -> pkg/top/ -> pkg/side/",
    }
    banned = breaks(graph, layers, apart={"pkg/side/": ("pkg/mid.py",)})
    assert banned["pkg/side/c.py -> pkg/mid.py"] == "pkg/side/ must not import pkg/mid.py"


def test_the_common_part_is_held_apart_from_both_sides():
    """APART keeps checkpoint/hf/ from importing checkpoint/training/ and every file at the top of checkpoint/
    (the common part) from importing either side: a file added there is covered too, or this test names it."""
    top = sorted(p.name for p in (ROOT / "step35" / "checkpoint").glob("*.py"))
    assert top == sorted(CHECKPOINT_COMMON)
    sides = {"step35/checkpoint/hf/", "step35/checkpoint/training/"}
    assert all((ROOT / side).is_dir() for side in sides)
    for name in top:
        assert set(APART[f"step35/checkpoint/{name}"]) == sides, name
    assert APART["step35/checkpoint/hf/"] == ("step35/checkpoint/training/",)
