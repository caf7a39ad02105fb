"""clgpt/ shows its layers: each module sits in one layer, imports only its own layer and those below, and no
two modules import each other, directly or around a loop; every module is short."""

from __future__ import annotations

from pathlib import Path

import pytest

from clgpt.stage import _imports

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600

# Lowest first. A package name covers every module under it. The model's shape (clgpt.model) sits at the bottom:
# the launchers size their kernels by it, and every layer above reads it.
LAYERS = [
    ("base", ["clgpt", "clgpt.errors", "clgpt.paths", "clgpt.atomic", "clgpt.ranks", "clgpt.signals", "clgpt.model",
              "clgpt.config"]),
    ("device", ["clgpt.device", "clgpt.ops"]),
    ("models", ["clgpt.models"]),
    ("text", ["clgpt.text"]),
    ("io", ["clgpt.io"]),
    ("data", ["clgpt.data"]),
    ("training", ["clgpt.training"]),
    ("inference", ["clgpt.inference"]),
    ("eval", ["clgpt.eval"]),
    ("app", ["clgpt.cli", "clgpt.__main__", "clgpt.bench", "clgpt.runner", "clgpt.stage"]),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "clgpt").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def layer(module: str) -> int:
    """The index in LAYERS of the longest name that is `module` or a package holding it."""
    best = None
    for rank, (_, names) in enumerate(LAYERS):
        for name in names:
            covers = module == name or (name != "clgpt" and module.startswith(name + "."))
            if covers and (best is None or len(name) > len(best[0])):
                best = (name, rank)
    assert best is not None, f"{module}: in no layer; add it to LAYERS in {Path(__file__).name}"
    return best[1]


def imported(module: str) -> set[str]:
    """The package modules `module` imports (also inside functions), less its own enclosing packages, whose
    __init__ Python runs first whatever the module imports."""
    own = {module.rsplit(".", n)[0] for n in range(1, module.count(".") + 1)}
    return {m for m in _imports(MODULES[module], module) if m in MODULES and m != module} - own


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_its_layer_and_those_below(module):
    mine = layer(module)
    for other in sorted(imported(module)):
        assert layer(other) <= mine, (f"{module} ({LAYERS[mine][0]}) imports {other} ({LAYERS[layer(other)][0]}), "
                                      "a layer above it; move what it needs down")


def test_no_import_runs_in_a_circle():
    """The engine base imports no architecture: make_engine lives apart (clgpt.models.factory)."""
    graph = {m: imported(m) for m in MODULES}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            pytest.fail("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m not in done:
            for other in sorted(graph[m]):
                visit(other, path + [m])
            done.add(m)

    for m in sorted(graph):
        visit(m, [])
    assert "clgpt.models.base" in graph["clgpt.models.gpt2"] and not graph["clgpt.models.base"] & {
        "clgpt.models.gpt2", "clgpt.models.llama", "clgpt.models.factory"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_is_short(module):
    lines = MODULES[module].read_text().count("\n")
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(ROOT)}: {lines} lines, split it"


def test_every_layer_is_a_folder_or_a_named_module():
    """Each name in LAYERS is a real module or package, so a rename cannot leave a stale entry behind."""
    for _, names in LAYERS:
        for name in names:
            assert name in MODULES, f"{name}: no such module"
