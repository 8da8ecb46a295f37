"""The checkpoint package's layering, read from the source: imports go one way (format I/O below the
code that fills a model, below model <-> folder glue; the training side over the HF side over the
common part), and one module owns the atomic switch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "step35"


def imports(file: Path, top_level_only: bool) -> set[str]:
    """step35 modules that `file` imports (module level only, or anywhere)."""
    tree = ast.parse(file.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("step35"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("step35"))
    return out


def module_name(file: Path) -> str:
    parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_checkpoint_modules_import_one_way():
    """Every import inside step35/checkpoint, lazy ones included, forms a DAG."""
    files = sorted((PACKAGE / "checkpoint").rglob("*.py"))
    graph = {
        module_name(f): {m for m in imports(f, top_level_only=False) if m.startswith("step35.checkpoint")}
        for f in files
    }
    graph = {m: deps - {m, "step35.checkpoint"} for m, deps in graph.items() if m != "step35.checkpoint"}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import circle: {' -> '.join(path + (module,))}"
        if module in done:
            return
        for dep in graph.get(module, ()):
            visit(dep, path + (module,))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_format_io_knows_no_model():
    hf = imports(PACKAGE / "checkpoint" / "hf" / "folder.py", top_level_only=False)
    assert not {m for m in hf if m.startswith("step35.model") or m.endswith(("materialize", "pretrained"))}, hf


def test_model_reaches_checkpoints_only_through_the_pretrained_glue():
    for file in sorted((PACKAGE / "model").glob("*.py")):
        assert not {m for m in imports(file, top_level_only=True) if m.startswith("step35.checkpoint")}, file
        lazy = {m for m in imports(file, top_level_only=False) if m.startswith("step35.checkpoint")}
        assert lazy <= {"step35.checkpoint.hf.pretrained"}, (file, lazy)


def test_one_atomic_switch():
    """Temporary siblings and their swap are spelled in publish.py only; every save calls it."""
    for file in sorted(PACKAGE.rglob("*.py")):
        if file.name == "publish.py" or "data" in file.parts:
            continue
        text = file.read_text()
        for spelling in ('.partial"', ".partial-", '.old"', ".old-", "shutil.move"):
            assert spelling not in text, (file, spelling)
    for writer in ("hf/folder.py", "hf/peft.py", "training/trainer_io.py"):
        assert "publish(tmp" in (PACKAGE / "checkpoint" / writer).read_text(), writer
    assert "save_sharded(" in (PACKAGE / "strategy.py").read_text()  # its sharded saves: trainer_io's writer
