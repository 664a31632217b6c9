"""The library's module map holds: one communication module, no import cycle, one front door, short modules."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "vparallel_ce"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        yield name, path, ast.parse(path.read_text())


def _internal_imports(name: str, tree: ast.Module, is_package: bool, modules) -> set[str]:
    """Modules of the package that ``name`` imports anywhere: at module level or inside a function
    (an import deferred into a function still ties the two modules together). ``from . import x``
    imports the module ``x`` where there is one, else the name ``x`` of the package's
    ``__init__``."""
    base = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            parts = base.split(".")
            root = ".".join(parts[: len(parts) - node.level + 1])
            if node.module:
                found.add(f"{root}.{node.module}")
                continue
            for a in node.names:
                found.add(f"{root}.{a.name}" if f"{root}.{a.name}" in modules else root)
    return found


def test_only_comm_calls_torch_distributed():
    offenders = []
    for name, path, tree in _modules():
        if name == "vparallel_ce.comm":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                # DTensor / DeviceMesh types are read by the front door; collectives are not
                if any(m == "torch.distributed" for m in mods):
                    offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, f"torch.distributed imported outside comm.py: {offenders}"


def test_no_import_cycle():
    modules = {name: (path, tree) for name, path, tree in _modules()}
    graph = {name: {m for m in _internal_imports(name, tree, path.name == "__init__.py", modules)
                   if m in modules and m != name}
             for name, (path, tree) in modules.items()}
    graph.pop("vparallel_ce")  # the package's __init__ re-exports everything
    for deps in graph.values():
        deps.discard("vparallel_ce")
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in graph.get(node, ()):
            if state.get(dep) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(stack + [node, dep])}")
            if dep not in state:
                visit(dep, stack + [node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])


def test_every_op_goes_through_the_front_door():
    # the ops' autograd Functions read a Call; only call.py builds one from user arguments
    for name in ("cross_entropy", "linear"):
        source = (PACKAGE / f"{name}.py").read_text()
        assert "_call(" in source and "agree(" not in source and "check_options(" not in source, name


def test_the_module_map_in_the_design_doc_names_every_module():
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    block = design.split("## Module map", 1)[1].split("```")[1]
    listed = {line.split()[0] for line in block.splitlines()[1:] if line.strip()}
    modules = {path.name if path.parent == PACKAGE else f"{path.parent.name}/" for path in PACKAGE.glob("*/*.py")}
    modules |= {path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    modules |= {path.name for path in (PACKAGE / "kernels").glob("*.py") if path.name != "__init__.py"}
    missing = sorted(m for m in modules if m not in listed)
    assert not missing, f"docs/design.md's module map lacks {missing}"


def test_no_library_module_is_longer_than_450_lines():
    # one idea per module: a module past this has grown a second subject worth its own file
    long = sorted(f"{path.relative_to(PACKAGE)}: {n}" for path in PACKAGE.rglob("*.py")
                  if (n := len(path.read_text().splitlines())) > 450)
    assert not long, f"library modules over 450 lines: {long}"


def test_importing_the_library_imports_neither_dynamo_nor_an_integrations_framework():
    """``import vparallel_ce`` costs every spawned rank: torch._dynamo (about 1.5 s, with sympy) is
    imported where a call is compiled, torchtitan, transformers and peft where an integration is used."""
    heavy = ("torch._dynamo", "sympy", "torchtitan", "transformers", "peft")
    code = ("import sys, vparallel_ce, vparallel_ce.integrations, vparallel_ce.pipeline; "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["[]"], f"importing vparallel_ce imported {proc.stdout.strip()}"
