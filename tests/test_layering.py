"""Imports flow one way through dspec.

Every module under ``dspec/`` is read with :mod:`ast` (module-level and function-level
``import`` / ``from ... import`` statements, relative imports resolved), and the module graph
they make must have

* no cycle between modules;
* no edge that goes up the layer order below (a function-level import counts like any
  other: it runs the same code, only later);
* no ``_private`` name taken from another module, and no private module (``_name.py``)
  imported from outside the package that holds it, except the allow-listed ones below.

The layers, bottom to top (a module may import its own layer and the ones below it):

=========  ===================================================================================
base       what every layer shares and that imports only its own layer: ``dspec._C`` (the
           extension), ``_backend``, ``_library``, ``_validate``, ``types``, ``cpu``,
           ``_cli`` (the command-line plumbing of every dspec command, training's included),
           ``tasks`` (problem sets), ``corpora`` (training documents, data-engine
           directories), ``testing`` (test helpers)
kernels    ``dspec.kernels``: the Triton wrappers
reference  ``dspec.reference``: the torch oracles of the ops
ops        ``dspec.ops`` and ``dspec.masks`` (the suffix-mask builders over ``ops.masks``)
models     ``dspec.models`` (model, drafter and adapter loading included) and ``dspec.hub``
decode     ``dspec.decode``: the methods and ``generate``; ``dspec.compat``: other libraries'
           signatures (flashinfer's) over the ops; ``dspec.hf``: ``generate`` as a
           transformers ``custom_generate`` over the HF model's own weights
api        ``dspec`` itself (the package's ``__init__``: the public names)
train      ``dspec.train``: nothing below it imports it
cli        ``dspec.__main__`` and ``dspec.bench_e2e`` (the ``bench`` command)
=========  ===================================================================================

The implicit import of a package's ``__init__`` when one of its modules is imported is not
an edge here (every module's import runs ``dspec/__init__``); what a module names is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "dspec"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "dspec._C",
            "dspec._backend",
            "dspec._library",
            "dspec._validate",
            "dspec.types",
            "dspec.cpu",
            "dspec._cli",
            "dspec.tasks",
            "dspec.corpora",
            "dspec.testing",
        ),
    ),
    ("kernels", ("dspec.kernels",)),
    ("reference", ("dspec.reference",)),
    ("ops", ("dspec.ops", "dspec.masks")),
    ("models", ("dspec.models", "dspec.hub")),
    ("decode", ("dspec.decode", "dspec.compat", "dspec.hf")),
    ("api", ("dspec",)),
    ("train", ("dspec.train",)),
    ("cli", ("dspec.__main__", "dspec.bench_e2e")),
]

#: upward edges that are right: (importer, imported) -> why.  Empty: none is.
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}

#: private names (or private modules) a module takes from another: (importer, module,
#: name) -> why.  Each is a documented internal of the package both modules are in.
PRIVATE_ALLOWED: dict[tuple[str, str, str], str] = {}


def module_files() -> dict[str, Path]:
    """Every dspec module: its dotted name -> its file (the extension as dspec._C)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    for path in ROOT.glob("_C*.so"):
        out["dspec._C"] = path
    out.setdefault("dspec._C", ROOT / "_C")
    return out


MODULES = module_files()


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def resolve(importer: str, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` inside ``importer``."""
    if level == 0:
        return module or ""
    package = importer if is_package(importer) else importer.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{module}" if module else package


def known(name: str) -> str | None:
    """The dspec module ``name`` is, or lies in (``dspec.x.y.attr`` -> ``dspec.x.y``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(name: str) -> list[tuple[str, str | None, int]]:
    """What module ``name`` imports from dspec: (module, the name taken from it or None, line)."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = known(alias.name)
                if target:
                    out.append((target, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, node.level, node.module)
            if not known(base) == base:
                continue  # not dspec (torch, numpy, ...)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:  # ``from pkg import module``
                    out.append((sub, None, node.lineno))
                else:
                    out.append((base, alias.name, node.lineno))
    return out


EDGES = {name: imports(name) for name in MODULES if MODULES[name].suffix == ".py"}


def layer_of(name: str) -> int:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or (p != "dspec" and name.startswith(p + "."))) and len(p) > depth:
                best, depth = i, len(p)
    assert best is not None, f"{name} has no layer: add it to LAYERS"
    return best


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_no_upward_import():
    bad = []
    for importer, targets in EDGES.items():
        for target, _, line in targets:
            if layer_of(target) > layer_of(importer) and (importer, target) not in UPWARD_ALLOWED:
                bad.append(
                    f"{MODULES[importer].relative_to(ROOT.parent)}:{line}: {importer} "
                    f"({LAYERS[layer_of(importer)][0]}) imports {target} "
                    f"({LAYERS[layer_of(target)][0]})"
                )
    assert not bad, "imports that go up the layers:\n" + "\n".join(sorted(set(bad)))


def test_no_import_cycle():
    graph = {name: sorted({t for t, _, _ in targets if t != name}) for name, targets in EDGES.items()}
    # Tarjan's strongly connected components, iteratively
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = [0]

    def visit(root):
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    assert not cycles, "modules that import each other (directly or around a loop):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def _private_module(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split(".")[1:])


def test_no_private_import_across_modules():
    bad = []
    for importer, targets in EDGES.items():
        for target, attr, line in targets:
            where = f"{MODULES[importer].relative_to(ROOT.parent)}:{line}"
            if attr is not None and attr.startswith("_") and not attr.startswith("__") and target != importer:
                if (importer, target, attr) not in PRIVATE_ALLOWED:
                    bad.append(f"{where}: {importer} takes {attr} from {target}")
            if _private_module(target) and target != importer:
                # a private module belongs to the package that holds it
                owner = target.rpartition(".")[0]
                if (
                    not (importer == owner or importer.startswith(owner + "."))
                    and (importer, target, "") not in PRIVATE_ALLOWED
                ):
                    bad.append(f"{where}: {importer} imports {target}, private to {owner}")
    assert not bad, "private names used outside their module:\n" + "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("name", ["dspec.hub", "dspec.models", "dspec.decode"])
def test_layer_below_train_names_no_train(name):
    """Loading a model or decoding never needs the trainer (checked on the graph: nothing
    reachable from ``name`` is in dspec.train)."""
    seen, todo = set(), [name]
    while todo:
        node = todo.pop()
        if node in seen or node not in EDGES:
            continue
        seen.add(node)
        todo.extend(t for t, _, _ in EDGES[node])
    assert not [m for m in seen if m.startswith("dspec.train")]


def test_loading_and_decoding_import_no_trainer():
    """At run time too: importing dspec, its loader (adapters included) and every method
    leaves dspec.train unimported (a fresh interpreter, so no other test's import counts)."""
    import subprocess
    import sys

    code = (
        "import importlib, sys, dspec, dspec.hub, dspec.models.adapters\n"
        "g = importlib.import_module('dspec.decode.generate')\n"
        "[g.method_module(m) for m in g.ALL_METHODS]\n"
        "bad = sorted(m for m in sys.modules if m.startswith('dspec.train'))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert r.returncode == 0, r.stderr


def test_test_modules_import_no_other_test_module():
    """A test module's shared cases live in a helper module of tests/ (conftest.py,
    tiny_checkpoints.py, *_cases.py), never in another test module: importing a test module
    collects its tests a second time and couples two files' fixtures."""
    tests = Path(__file__).resolve().parent
    bad = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            bad += [f"{path.name} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not bad, bad


#: dspec's base-layer private modules (the module doc's table): the seams the tests may use
#: (the extension, the backend registry, argument checks, the command-line plumbing)
BASE_PRIVATE = {"_C", "_backend", "_library", "_validate", "_cli"}


def _dspec_aliases(tree: ast.Module) -> dict[str, str]:
    """The names a test module binds to dspec modules (``import dspec.x as y``, ``from dspec.x
    import y`` where ``dspec.x.y`` is a module): name -> dotted module."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "dspec":
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "dspec"
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] == "dspec":
                for a in node.names:
                    if known(f"{node.module}.{a.name}"):
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in BASE_PRIVATE


def test_test_modules_use_no_private_name_of_dspec():
    """Tests reach dspec through public names (of its modules) and the base layer's private
    modules, never through a ``_private`` function, class or constant: what a test needs is a
    public seam of the module it tests.  The Triton kernels' ``_..._kernel`` objects are the
    exception: the ahead-of-time compile check takes the jit functions themselves."""
    tests = Path(__file__).resolve().parent
    bad = []
    for path in sorted(tests.glob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = _dspec_aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module.split(".")[0] == "dspec":
                    bad += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                chain, value = [], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in aliases:
                    module = ".".join([aliases[value.id], *reversed(chain)])
                    if not (node.attr.endswith("_kernel") and module.startswith("dspec.kernels.")):
                        bad.append(f"{path.name}:{node.lineno} uses {module}.{node.attr}")
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "setattr" and len(node.args) >= 2:
                target, attr = node.args[0], node.args[1]
                if isinstance(target, ast.Name) and target.id in aliases and isinstance(attr, ast.Constant):
                    if isinstance(attr.value, str) and _private(attr.value):
                        bad.append(f"{path.name}:{node.lineno} patches {aliases[target.id]}.{attr.value}")
    assert not bad, "private names of dspec used by tests:\n" + "\n".join(bad)
