"""The layering of src/tensorshard, checked from its imports (parsed with `ast`, nothing is imported).

Layers, bottom to top (README, "How it is built"): a module may import its own layer and the layers below,
never one above; the packages import each other without a cycle, and so do the files (every import counted:
those inside functions and under TYPE_CHECKING too); checkpoint/ imports no engine and the two
engines do not import each other; only integrations/peft/ imports peft, and it sits below the transformers
integration; at most twelve imports sit inside functions, each deferring an optional heavy
dependency, with a comment saying so.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# (layer number, module-name prefixes); a module belongs to the layer of its longest matching prefix.
LAYERS = [
    (0, ["tensorshard.partition", "tensorshard.devices", "tensorshard.layers", "tensorshard.memory", "tensorshard.quant",
         "tensorshard.registrations", "tensorshard.trees", "tensorshard.logs", "tensorshard.switches",
         "tensorshard.global_hooks", "tensorshard.model_kind", "tensorshard.cache_dirs"]),
    (1, ["tensorshard.comm"]),
    (2, ["tensorshard.styles", "tensorshard.loss_parallel"]),
    (3, ["tensorshard.plans", "tensorshard.optimizers"]),
    (4, ["tensorshard.engines"]),
    (5, ["tensorshard.plan_inference"]),
    (6, ["tensorshard.checkpoint"]),
    (7, ["tensorshard.integrations"]),
    (8, ["tensorshard.api", "tensorshard.cli", "tensorshard.demo", "tensorshard.__main__", "tensorshard"]),
    (9, ["tensorshard.compat"]),  # the tensor_parallel package's API, on top of the front door
]
# Pairs of packages on the same layer or below that still must not meet.
FORBIDDEN = [
    ("tensorshard.checkpoint", "tensorshard.engines"),  # checkpoint works from plans.slices.SplitLayout
    ("tensorshard.engines.inprocess", "tensorshard.engines.torchrun"),
    ("tensorshard.engines.torchrun", "tensorshard.engines.inprocess"),
    # transformers' split models take their adapter methods from the PEFT package, never the other way round
    ("tensorshard.integrations.peft", "tensorshard.integrations.transformers"),
]
# Only the PEFT package imports peft (integrations/peft/__init__.py); below it, PEFT's layers are recognised by
# their attributes. Files outside it that may still import peft, each with its reason:
PEFT_OWNER = "tensorshard.integrations.peft"
PEFT_IMPORTS_ELSEWHERE = {
    "tensorshard.demo": "the demo is a user's script: it fine-tunes with PEFT's own API, as a user would",
}
# What an import inside a function may defer: optional heavy dependencies (pyproject's extras), and the
# integration that imports transformers at its top.
DEFERRABLE = ("transformers", "lightning", "peft", "safetensors", "gguf", "rich", "accelerate", "bitsandbytes",
              "tensorshard.integrations.transformers")
MAX_FUNCTION_IMPORTS = 12  # 10, then transformers' two weight-conversion modules (checkpoint/conversions.py)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. tensorshard.plans.plan
    target: str  # the imported module (for `from X import y`: X.y when X.y is a module, else X)
    in_function: bool = False
    commented: bool = False  # a comment on the line or the line above
    where: str = ""


def _module_name(path: Path, src: Path = SRC) -> tuple[str, bool]:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def collect_imports(src: Path = SRC) -> list[Import]:
    files = sorted((src / "tensorshard").rglob("*.py"))
    modules = {_module_name(f, src)[0] for f in files}
    found = []
    for f in files:
        name, is_package = _module_name(f, src)
        package = name if is_package else name.rpartition(".")[0]
        lines = f.read_text().splitlines()
        tree = ast.parse("\n".join(lines))

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    if isinstance(child, ast.Import):
                        targets = [a.name for a in child.names]
                    else:
                        base = child.module or ""
                        if child.level:
                            up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                            base = ".".join(up + ([child.module] if child.module else []))
                        # `from pkg import module` imports the module
                        targets = sorted({f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names})
                    line = lines[child.lineno - 1]
                    above = lines[child.lineno - 2].strip() if child.lineno > 1 else ""
                    commented = "#" in line or above.startswith("#")
                    for target in targets:
                        found.append(Import(name, target, in_function, commented, f"{f.relative_to(src)}:{child.lineno}"))
                visit(child, inside)

        visit(tree, False)
    return found


def layer_of(module: str) -> int | None:
    best = None
    for layer, prefixes in LAYERS:
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (layer, prefix)
    return None if best is None else best[0]


def unit_of(module: str, packages: set[str]) -> str:
    """The package a module belongs to (a top-level module is a unit of its own)."""
    if module in packages:
        return module
    parent = module.rpartition(".")[0]
    return parent if parent in packages and parent != "tensorshard" else module


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


def file_edges(imports: list[Import]) -> dict[str, set[str]]:
    """Which module imports which (a package stands for its __init__.py), every import counted: one inside a
    function or under ``if TYPE_CHECKING`` still means the two files need each other."""
    edges: dict[str, set[str]] = {}
    for i in imports:
        if i.module != i.target:
            edges.setdefault(i.module, set()).add(i.target)
    return edges


def problems(imports: list[Import], packages: set[str]) -> list[str]:
    """Every way `imports` breaks the layering (empty: none)."""
    out = []
    ours = [i for i in imports if i.target == "tensorshard" or i.target.startswith("tensorshard.")]
    for i in ours:
        a, b = layer_of(i.module), layer_of(i.target)
        if a is None or b is None:
            out.append(f"{i.where}: {i.module} or {i.target} is on no layer; add it to LAYERS")
        elif b > a:
            out.append(f"{i.where}: {i.module} (layer {a}) imports {i.target} (layer {b}), which is above it")
        for low, high in FORBIDDEN:
            if (i.module == low or i.module.startswith(low + ".")) and (i.target == high or i.target.startswith(high + ".")):
                out.append(f"{i.where}: {i.module} imports {i.target}; {low} must not import {high}")
    edges: dict[str, set[str]] = {}
    for i in ours:
        a, b = unit_of(i.module, packages), unit_of(i.target, packages)
        if a != b:
            edges.setdefault(a, set()).add(b)
    cycle = find_cycle(edges)
    if cycle:
        out.append("import cycle between packages: " + " -> ".join(cycle))
    cycle = find_cycle(file_edges(ours))
    if cycle:
        out.append("import cycle between files: " + " -> ".join(cycle))
    for i in imports:
        if (i.target == "peft" or i.target.startswith("peft.")) and not (
            i.module == PEFT_OWNER or i.module.startswith(PEFT_OWNER + ".") or i.module in PEFT_IMPORTS_ELSEWHERE
        ):
            out.append(f"{i.where}: {i.module} imports {i.target}; only {PEFT_OWNER} imports peft (move the code there)")
    deferred = [i for i in imports if i.in_function]
    if len(deferred) > MAX_FUNCTION_IMPORTS:
        out.append(f"{len(deferred)} imports inside functions (at most {MAX_FUNCTION_IMPORTS}): " + ", ".join(i.where for i in deferred))
    for i in deferred:
        if not any(i.target == d or i.target.startswith(d + ".") for d in DEFERRABLE):
            out.append(f"{i.where}: {i.module} imports {i.target} inside a function; import it at the top (only optional heavy dependencies may wait)")
        elif not i.commented:
            out.append(f"{i.where}: the deferred import of {i.target} needs a comment saying why it waits")
    return out


def _packages(src: Path = SRC) -> set[str]:
    return {_module_name(f, src)[0] for f in (src / "tensorshard").rglob("__init__.py")}


def test_the_source_follows_the_layers():
    imports = collect_imports()
    assert len(imports) > 200  # the parser sees the real tree
    found = problems(imports, _packages())
    assert not found, "\n".join(found)


def test_the_compat_modules_import_each_other_one_way():
    """tensorshard.compat's modules form no import cycle (annotation-only imports count too): config -> translate
    -> check -> rules -> state_actions."""
    edges: dict[str, set[str]] = {}
    for i in collect_imports():
        if i.module.startswith("tensorshard.compat.") and i.target.startswith("tensorshard.compat.") and i.module != i.target:
            edges.setdefault(i.module, set()).add(i.target)
    assert len(edges) >= 5 and find_cycle(edges) is None, find_cycle(edges)


# File names that repeat, each meaning the same thing in every package that has one.
SAME_MEANING = {
    "__init__.py": "a package",
    "engine.py": "an engine's split-model class (engines/inprocess, engines/torchrun)",
    "copies.py": "copy.deepcopy of a split model, per engine",
}


def test_a_file_name_repeats_only_where_it_means_the_same_thing():
    by_name: dict[str, list[str]] = {}
    for f in (SRC / "tensorshard").rglob("*.py"):
        by_name.setdefault(f.name, []).append(str(f.relative_to(SRC)))
    repeated = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name not in SAME_MEANING}
    assert not repeated, f"file names that repeat: {repeated}; name each file for what it holds"


def test_every_module_is_on_a_layer():
    modules = {_module_name(f)[0] for f in (SRC / "tensorshard").rglob("*.py")}
    assert [m for m in sorted(modules) if layer_of(m) is None] == []


PACKAGES = {"tensorshard", "tensorshard.comm", "tensorshard.plans", "tensorshard.engines", "tensorshard.engines.inprocess",
            "tensorshard.checkpoint"}


@pytest.mark.parametrize(
    "bad, expected",
    [
        # an import running up the layers: comm (1) importing the engines (4)
        ([Import("tensorshard.comm.dist", "tensorshard.engines.inprocess.engine", where="x.py:1")], "which is above it"),
        # a cycle between packages of one layer
        (
            [Import("tensorshard.plans.a", "tensorshard.plans.presets.b", where="a.py:1"),
             Import("tensorshard.plans.presets.b", "tensorshard.plans.a", where="b.py:1")],
            "import cycle between packages",
        ),
        # checkpoint reaching into an engine (allowed by the layer order alone)
        ([Import("tensorshard.checkpoint.layout", "tensorshard.engines.torchrun.engine", where="c.py:1")],
         "must not import tensorshard.engines"),
        # a cycle between two files of one package, one side deferred into a function
        (
            [Import("tensorshard.plans.presets", "tensorshard.plans.presets.gpt", where="__init__.py:1"),
             Import("tensorshard.plans.presets.gpt", "tensorshard.plans.presets", in_function=True, commented=True,
                    where="gpt.py:9")],
            "import cycle between files",
        ),
        # peft imported outside the PEFT package
        ([Import("tensorshard.plans.rewriters", "peft.tuners", where="rewriters.py:3")], "only tensorshard.integrations.peft"),
        # the PEFT package reaching up into the transformers integration
        ([Import("tensorshard.integrations.peft.after_split", "tensorshard.integrations.transformers.model",
                 where="after_split.py:3")], "must not import tensorshard.integrations.transformers"),
        # a function-level import hiding a cycle instead of an optional dependency
        ([Import("tensorshard.plans.plan", "tensorshard.styles.style", in_function=True, commented=True, where="p.py:9")],
         "import it at the top"),
        # an optional dependency deferred without a comment
        ([Import("tensorshard.cli", "rich.table", in_function=True, where="cli.py:3")], "needs a comment"),
        # too many deferred imports
        ([Import("tensorshard.cli", "rich", in_function=True, commented=True, where=f"cli.py:{n}") for n in range(13)],
         "13 imports inside functions"),
    ],
)
def test_the_check_catches_a_bad_import_graph(bad, expected):
    packages = PACKAGES | {"tensorshard.plans.presets", "tensorshard.engines.torchrun"}
    found = problems(bad, packages)
    assert any(expected in p for p in found), found


def test_a_clean_graph_passes():
    good = [
        Import("tensorshard.engines.inprocess.engine", "tensorshard.plans.plan"),
        Import("tensorshard.plans.plan", "tensorshard.styles.style"),
        Import("tensorshard.checkpoint.gguf", "gguf", in_function=True, commented=True),
    ]
    assert problems(good, PACKAGES) == []


# Where the model's kind (model_kind.py) may be asked: once per split, where the split begins. The front door hands
# the answer on to the engine, the plan resolution and the automatic plan; tests/core/test_model_kind.py counts the
# calls during a split (one).
KIND_ASKED = {
    "tensorshard/api.py": "the front door, tensor_parallel()",
    "tensorshard/plan_inference/auto.py": "only when no kind was handed on (parallelize, the CLI, hand loading)",
    "tensorshard/engines/inprocess/copies.py": "copy.deepcopy of a split model is a new split, of the copy",
    "tensorshard/compat/entry.py": "TensorParallelPreTrainedModel's check of what it was given, before it splits (a copy)",
}


def test_the_model_kind_is_asked_only_where_a_split_begins():
    asked = set()
    for f in sorted((SRC / "tensorshard").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "model_kind":
                asked.add(f.relative_to(SRC).as_posix())
    assert asked <= set(KIND_ASKED), f"model_kind() asked in {sorted(asked - set(KIND_ASKED))}: take the kind handed on"


# PEFT's behaviour lives in integrations/peft/: the code below it reaches PEFT's models and layers only through the
# registries the package fills (model_kind.register_holder_kind, layers.register_layer_wrapper, the plan rewriter,
# the engines' adopters). Outside it, no name in code (an identifier, or a string that is one: an attribute read)
# is PEFT's; prose (docstrings, messages) may mention PEFT. Files that still name it, each with its reason:
PEFT_NAMES = re.compile(r"peft|lora|adapter|modules_to_save|base_layer|original_module|ia3", re.IGNORECASE)
PEFT_NAMED_ELSEWHERE = {
    "tensorshard/__init__.py": "imports the PEFT package, whose import fills the registries",
    "tensorshard/demo.py": "the demo is a user's script: it fine-tunes with PEFT's own API, as a user would",
    "tensorshard/compat/entry.py": "the original API's TensorParallelPreTrainedModel takes a PeftModel: it asks "
                                   "integrations/peft/recognised.py",
    "tensorshard/integrations/transformers/__init__.py": "hands a PeftModel to integrations/peft (transformers' "
                                                         "integration sits above PEFT's, never the reverse)",
    "tensorshard/integrations/transformers/model.py": "takes transformers' add_adapter/load_adapter from "
                                                      "integrations/peft (SplitAdapters)",
    "tensorshard/integrations/transformers/split_logits.py": "a PeftModel passes its inner model's logits through",
}


def _names_in_code(tree: ast.AST) -> list[tuple[int, str]]:
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname or ""]
        elif isinstance(node, (ast.arg, ast.keyword)):
            names = [node.arg or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names = [node.value] if node.value.isidentifier() else []
        else:
            continue
        found += [(getattr(node, "lineno", 0), n) for n in names if PEFT_NAMES.search(n)]
    return found


def test_peft_aware_names_appear_only_in_the_peft_package():
    outside = []
    for f in sorted((SRC / "tensorshard").rglob("*.py")):
        where = f.relative_to(SRC).as_posix()
        if where.startswith("tensorshard/integrations/peft/") or where in PEFT_NAMED_ELSEWHERE:
            continue
        outside += [f"{where}:{line}: {name}" for line, name in _names_in_code(ast.parse(f.read_text()))]
    assert outside == [], "PEFT's names outside integrations/peft/ (reach them through its registries):\n" + "\n".join(outside)


def test_the_peft_name_check_sees_code_not_prose():
    code = ast.parse('"""LoRA in prose."""\nx = layer.base_layer\ngetattr(m, "lora_A")\nraise ValueError("adapters: no")\n')
    assert [n for _, n in _names_in_code(code)] == ["base_layer", "lora_A"]
