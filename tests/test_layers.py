"""The package graph runs one way: no module of xmoe imports a module of a layer above its own, and no module
imports itself through others (no circle of imports, file by file, inside a layer either).

The allowed order is written once, in LAYERS below (docs/architecture.md shows it); a module may import its own
layer and any layer below. Imports inside functions count too: a lazy import is still a dependency.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "xmoe"

# Bottom first. Each entry names a module or a package (all its modules); "xmoe" is the package's own __init__.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("xmoe._version", "xmoe.checks", "xmoe.model_config", "xmoe.config", "xmoe.log"),
    ("xmoe.data",),
    ("xmoe.kernels",),
    ("xmoe.dispatch",),
    ("xmoe.moe",),
    ("xmoe.model", "xmoe.hf"),
    ("xmoe.parallel",),
    ("xmoe.plan",),
    ("xmoe.train", "xmoe.bench", "xmoe.bench_cli"),
    ("xmoe.cli", "xmoe.infer", "xmoe.__main__", "xmoe"),
)


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest entry naming ``module`` (the root entry "xmoe" names only xmoe/__init__)."""
    best, best_len = -1, -1
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            hit = module == entry or (entry != "xmoe" and module.startswith(entry + "."))
            if hit and len(entry) > best_len:
                best, best_len = index, len(entry)
    if best < 0:
        raise AssertionError(f"module {module} is in no layer: add it (or its package) to LAYERS")
    return best


def module_sources(package: Path = PACKAGE) -> dict[str, str]:
    """Dotted module name -> source text of every .py file under ``package``."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path.read_text()
    return out


def imported_modules(name: str, source: str, known: set[str]) -> set[str]:
    """The xmoe modules ``name`` imports (``from pkg import sub`` resolves to pkg.sub when that is a module)."""
    is_package = any(k.startswith(name + ".") for k in known) or name == "xmoe"
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: strip the module itself (unless a package) and level - 1 parents
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1) - (0 if is_package else 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m == "xmoe" or m.startswith("xmoe.")}


def upward_imports(sources: dict[str, str]) -> list[str]:
    known = set(sources)
    bad = []
    for name, source in sources.items():
        for target in sorted(imported_modules(name, source, known)):
            if layer_of(target) > layer_of(name):
                bad.append(f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})")
    return bad


def import_cycles(sources: dict[str, str]) -> list[str]:
    """One circle of imports per strongly connected group of modules, as ``a -> b -> a`` from its first module
    (Tarjan's algorithm; then the shortest way round through the group)."""
    known = set(sources)
    graph = {name: sorted(imported_modules(name, source, known) & known - {name}) for name, source in sources.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for name in sorted(graph):
        if name not in index:
            visit(name)
    cycles = []
    for group in groups:
        start = min(group)
        paths, frontier = {start: [start]}, [start]
        while frontier:  # breadth first inside the group, until a module leads back to the start
            node = frontier.pop(0)
            if start in graph[node]:
                cycles.append(" -> ".join(paths[node] + [start]))
                break
            for target in graph[node]:
                if target in group and target not in paths:
                    paths[target] = paths[node] + [target]
                    frontier.append(target)
    return sorted(cycles)


def render_layers() -> str:
    """The order as docs/architecture.md shows it, bottom first."""
    return " < ".join(", ".join(f"`{e}`" for e in entries) for entries in LAYERS)


def test_no_module_imports_a_layer_above_it():
    sources = module_sources()
    assert len(sources) > 30  # the walk found the package
    assert upward_imports(sources) == []


def test_no_circle_of_imports():
    assert import_cycles(module_sources()) == []


def test_checker_finds_planted_circles():
    fake = {
        "xmoe": "",
        "xmoe.a": "from xmoe import b\n",
        "xmoe.b": "def f():\n    from xmoe.c import thing\n",  # a lazy import closes the circle
        "xmoe.c": "from . import a\nimport xmoe.d\n",
        "xmoe.d": "from xmoe.a import thing\n",  # a second way round the same group
        "xmoe.e": "from xmoe import a\n",  # imports into the circle, is not part of it
        "xmoe.p": "from xmoe.p import q\n",  # a package importing its own module, which imports it back
        "xmoe.p.q": "from xmoe.p import VALUE\n",
        "xmoe.self": "import xmoe.self\n",  # a module naming itself is no circle
    }
    assert import_cycles(fake) == ["xmoe.a -> xmoe.b -> xmoe.c -> xmoe.a", "xmoe.p -> xmoe.p.q -> xmoe.p"]
    del fake["xmoe.b"], fake["xmoe.p.q"]
    assert import_cycles(fake) == []


def test_every_layer_entry_exists():
    # a stale entry would let a renamed package fall silently into another layer
    names = set(module_sources())
    for entries in LAYERS:
        for entry in entries:
            assert entry in names, f"LAYERS names {entry}, which is not a module or package of xmoe"


def test_checker_catches_upward_and_lazy_imports():
    fake = {
        "xmoe": "",
        "xmoe.config": "",
        "xmoe.dispatch": "",
        "xmoe.dispatch.routing": "from xmoe.config import MoEConfig\n",
        "xmoe.moe": "",
        "xmoe.moe.layer": "from xmoe.dispatch import routing\n",
        "xmoe.model": "",
        "xmoe.model.counting": "def f():\n    from xmoe.train.metrics import FlopDims\n",
        "xmoe.train": "",
        "xmoe.train.metrics": "",
        "xmoe.train.checkpoint": "from xmoe import __version__\n",
        "xmoe.dispatch.local": "from ..moe import layer\n",
    }
    assert upward_imports(fake) == [
        "xmoe.model.counting (layer 5) imports xmoe.train.metrics (layer 8)",
        "xmoe.train.checkpoint (layer 8) imports xmoe (layer 9)",
        "xmoe.dispatch.local (layer 3) imports xmoe.moe.layer (layer 4)",
    ]


# the run directory's pieces, which RunDir (xmoe/train/rundir.py) composes; the DCP state (checkpoint.py) is apart
RUN_DIR_PIECES = (
    "xmoe.train.runlock",
    "xmoe.train.run_outputs",
    "xmoe.train.checkpoint_dir",
    "xmoe.train.checkpoint_verify",
    "xmoe.train.resume",
)


def test_the_trainer_and_the_readers_hold_the_run_directory_as_one_object():
    sources = module_sources()
    for user in ("xmoe.train.trainer", "xmoe.infer"):
        reached = imported_modules(user, sources[user], set(sources)) & set(RUN_DIR_PIECES)
        assert not reached, f"{user} imports {sorted(reached)}: use the run directory through rundir.RunDir"


def test_architecture_doc_shows_the_layers():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert render_layers() in doc, f"docs/architecture.md should show the layer order:\n{render_layers()}"


MAX_MODULE_LINES = 450


def test_no_module_is_over_the_line_limit():
    # a module that grows past this mixes concerns more often than not: split it by concern
    long = {
        str(path.relative_to(ROOT)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
