"""The trainer meets the MoE layers at one seam, xmoe/moe/step.py's MoEStep: no module of xmoe/train/ sets or reads an
attribute of an MoE module (a layer, its router, experts or shared experts, a dispatcher). Checked on the source,
as tests/test_layers.py checks imports:

  * the MoE modules are the nn.Module classes of xmoe/moe/ and the dispatchers of xmoe/dispatch/; their attribute
    names are collected from their classes (methods, class attributes, what their methods assign to ``self``,
    registered buffers and parameters);
  * xmoe/train/ imports none of those classes and never collects MoE layers (``moe_layers``), so it holds no MoE
    module to begin with;
  * and no attribute it reads or sets, directly or through getattr / setattr / hasattr, carries one of those names,
    except on a config (``....moe``, the MoEConfig: ``dispatcher``, ``num_experts`` are config fields too; ``run``,
    the RunConfig: its ``kernels`` section is what the layers' ``kernels`` are built from) or on the parsed command
    line (``args``).

xmoe/parallel/ may install dispatchers and shard expert weights: that is parallelism applied from outside.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "xmoe"
SEAM = PACKAGE / "moe" / "step.py"
ACCESSORS = ("getattr", "setattr", "hasattr", "delattr")


def _bases(node: ast.ClassDef) -> set[str]:
    return {ast.unparse(b).split(".")[-1] for b in node.bases}


def moe_classes(sources: dict[Path, str]) -> dict[str, ast.ClassDef]:
    """The MoE module classes by name: nn.Modules of xmoe/moe/ (the seam apart) and dispatchers of xmoe/dispatch/,
    with the classes derived from them."""
    classes: dict[str, ast.ClassDef] = {}
    candidates = [
        (path, node)
        for path, source in sources.items()
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and path != SEAM
    ]
    found = True
    while found:  # to a fixed point: subclasses of collected classes count too
        found = False
        for path, node in candidates:
            if node.name in classes:
                continue
            module = path.parent.name == "moe" and "Module" in _bases(node)
            dispatcher = path.parent.name == "dispatch" and node.name.endswith("Dispatcher")
            if module or dispatcher or _bases(node) & set(classes):
                classes[node.name], found = node, True
    return classes


def attribute_names(node: ast.ClassDef) -> set[str]:
    names = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    for sub in ast.walk(node):
        targets = (
            sub.targets
            if isinstance(sub, ast.Assign)
            else [sub.target]
            if isinstance(sub, (ast.AnnAssign, ast.AugAssign))
            else []
        )
        names.update(t.attr for t in targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self")
        if (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr in ("register_buffer", "register_parameter")
            and sub.args
            and isinstance(sub.args[0], ast.Constant)
        ):
            names.add(sub.args[0].value)
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def _on_a_config(base: ast.expr) -> bool:
    text = ast.unparse(base)
    return text in ("args", "run", "self.run") or text.endswith(".moe")


def seam_violations(train_sources: dict[str, str], classes: dict[str, ast.ClassDef]) -> list[str]:
    """``file:line what`` for each place a train module could touch an MoE module."""
    names = set().union(*(attribute_names(c) for c in classes.values()))
    bad = []
    for where, source in train_sources.items():
        for node in ast.walk(ast.parse(source)):
            line = f"{where}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("xmoe.moe", "xmoe.dispatch")):
                bad += [f"{line} imports {a.name}" for a in node.names if a.name in classes or a.name == "moe_layers"]
            elif isinstance(node, ast.Attribute) and node.attr == "moe_layers":
                bad.append(f"{line} collects MoE layers ({ast.unparse(node)})")
            elif isinstance(node, ast.Attribute) and node.attr in names and not _on_a_config(node.value):
                bad.append(f"{line} {ast.unparse(node)}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ACCESSORS
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in names
                and not _on_a_config(node.args[0])
            ):
                bad.append(f"{line} {node.func.id}(..., {node.args[1].value!r})")
    return bad


def _sources(folder: Path) -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(folder.rglob("*.py"))}


def _classes() -> dict[str, ast.ClassDef]:
    return moe_classes({**_sources(PACKAGE / "moe"), **_sources(PACKAGE / "dispatch")})


def test_the_collection_finds_the_moe_modules():
    classes = _classes()
    assert {
        "MoELayer",
        "Router",
        "RoutedExperts",
        "SwiGLU",
        "LocalDispatcher",
        "AllToAllDispatcher",
        "HierarchicalDispatcher",
        "PaddedDispatcher",
        "PaddedAllToAllDispatcher",
    } <= set(classes)
    assert "MoEStep" not in classes
    names = set().union(*(attribute_names(c) for c in classes.values()))
    assert {
        "router",
        "experts",
        "dispatcher",
        "moe_step",
        "last_stats",
        "expert_bias",
        "step_copies",
        "expert_weights",
        "stats",
        "fuses_experts",
        "update_bias",
    } <= names


def test_no_train_module_touches_an_moe_module():
    train = {str(path.relative_to(ROOT)): source for path, source in _sources(PACKAGE / "train").items()}
    assert len(train) > 10  # the walk found the package
    assert seam_violations(train, _classes()) == []


def test_checker_catches_what_the_side_channels_were():
    fake = {
        "a.py": "from xmoe.moe.layer import moe_layers\nfrom xmoe.moe.step import MoEStep\n",
        "b.py": "for layer in self.model.moe_layers():\n    layer.router.expert_bias.copy_(bias)\n",
        "c.py": "stats = getattr(layer.dispatcher, 'stats', None)\n",
        "d.py": "from xmoe.dispatch.alltoall import AllToAllDispatcher\nx = run.model.moe.num_experts\n",
        "e.py": "layer.aux_loss_scale = 0.5\nsetattr(experts, 'moe_step', None)\n",
    }
    old = ast.parse("class OldLayer(nn.Module):\n    def __init__(self):\n        self.aux_loss_scale = 1.0\n").body[0]
    assert seam_violations(fake, {**_classes(), "OldLayer": old}) == [
        "a.py:1 imports moe_layers",
        "b.py:1 collects MoE layers (self.model.moe_layers)",
        "b.py:2 layer.router.expert_bias",
        "b.py:2 layer.router",
        "c.py:1 getattr(..., 'stats')",
        "c.py:1 layer.dispatcher",
        "d.py:1 imports AllToAllDispatcher",
        "e.py:1 layer.aux_loss_scale",
        "e.py:2 setattr(..., 'moe_step')",
    ]
