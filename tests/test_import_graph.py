"""zoo's imports run one way, by folder: core (and kernels, the custom ops beside it) -> contract -> deploy (runner,
runtimes) -> export -> the export line (pipeline) -> command lines; the deploy side imports nothing of the exporter. Read with ``ast`` from the source (nothing is imported), so a circle that only shows at run time, behind an
import inside a function, is found too:
  - no import circle among zoo's modules;
  - no import of a zoo module inside a function body, except the ones listed below, each with its reason;
  - no module imports one of a higher layer;
  - the programs around the package (scripts/, benchmarks/, tools/) import zoo only: not each other, not tests/,
    and they leave sys.path alone (zoo is installed); tests/ runs them as programs at most, and loads none.
  - no test module imports another test module or conftest.py (what tests share lives in tests/support).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "zoo"

# Imports of a zoo module inside a function body that are allowed: (importer, imported) -> why.
# A zoo module may be imported inside a function only to keep lerobot or a GPU-only dependency optional.
ALLOWED_IN_FUNCTIONS: Dict[Tuple[str, str], str] = {
    ("zoo.contract.recipes", "zoo.rewrites"): "a recipe names its rewrites; checking the names needs the rewrite "
                                              "registry, which a deployment (the runner reading recipe.yaml) "
                                              "does not load",
}

# The layers, by folder: an import may go to the same layer or a lower one. The policies' registry and their
# options dataclasses type a recipe's unit.options, so they sit with the contract; a family's export unit
# (zoo/policies/NAME/unit.py and the modules it builds from) is part of the export line.
LAYER_NAMES = ("core", "contract", "deploy", "export", "export line", "command lines")


def layer_of(module: str) -> Optional[int]:
    """The layer of a zoo module, from the folder it lives in; None for the package ``zoo`` itself."""
    parts = module.split(".")
    if module == "zoo":
        return None
    if parts[-1] == "__main__":  # ``python -m zoo.export``: a command line wherever its package is
        return 5
    top = parts[1]
    if top in ("core", "kernels"):
        return 0
    if top == "contract" or module == "zoo.policies" or (top == "policies" and parts[-1] == "options") \
            or (top == "policies" and len(parts) == 3 and (ZOO / "policies" / parts[2]).is_dir()):
        return 1
    if top in ("runner", "runtimes"):
        return 2
    if top in ("export", "policies", "rewrites", "bench"):
        return 4 if module == "zoo.export.pipeline" else 3
    return 5  # zoo.cli, zoo.__main__


# What the deploy side may import, beyond itself: a deployment needs the runner, the artifact readers and a
# runtime, nothing of the exporter.
DEPLOY = ("zoo.runner", "zoo.runtimes")
DEPLOY_MAY_IMPORT = ("zoo.core", "zoo.kernels", "zoo.contract", "zoo.runner", "zoo.runtimes", "zoo.policies")

# The folders of programs around the package: each file runs as a program, with zoo installed.
PROGRAM_FOLDERS = ("scripts", "benchmarks", "tools")

# Test modules that name a file of those folders, and why: each runs it as a program and loads none of them.
TESTS_LOADING_SCRIPTS = {
    "tests/test_bench.py": "runs benchmarks/bench_chunk.py as a program (its refusal to record a tiny run)",
    "tests/test_gpu_jobs.py": "runs tools/gpu_jobs.sh as a program (bash)",
    "tests/test_levers.py": "runs benchmarks/lever_table.py as __main__ (runpy): its table, files and refusals",
    "tests/test_build_runtime.py": "runs scripts/build_runtime.sh as a program (bash), with stand-in tools",
    "tests/policies/test_bench_chunk_seeded.py": "runs benchmarks/bench_chunk.py as a program (the real-size "
                                                 "weights path at tiny size)",
}


class Import(NamedTuple):
    importer: str
    imported: str
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def zoo_modules() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted(ZOO.rglob("*.py"))}


def _walk(node: ast.AST, in_function: bool = False) -> Iterator[Tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield child, inside
        yield from _walk(child, inside)


def imports_of(name: str, path: Path, modules: Dict[str, Path]) -> List[Import]:
    """Every import of a zoo module in ``path``, resolved to module names (a name imported from a package is
    the submodule when there is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: List[Import] = []
    for node, in_function in _walk(ast.parse(path.read_text(), str(path))):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        for target in targets:
            if target == "zoo" or target.startswith("zoo."):
                found.append(Import(name, target, node.lineno, in_function))
    return found


def all_imports() -> List[Import]:
    modules = zoo_modules()
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def dependency_edges(imports: List[Import]) -> Dict[str, Set[str]]:
    """importer -> modules whose code runs when it imports: the module itself and, for a module in a package
    the importer is not part of, that package's ``__init__``."""
    edges: Dict[str, Set[str]] = {}
    for imp in imports:
        if imp.in_function and ALLOWED_IN_FUNCTIONS.get((imp.importer, imp.imported), "").startswith("pending:"):
            continue
        parts = imp.imported.split(".")
        for n in range(2, len(parts) + 1):
            target = ".".join(parts[:n])
            if target != imp.importer and not imp.importer.startswith(target + "."):
                edges.setdefault(imp.importer, set()).add(target)
    return edges


def find_cycle(edges: Dict[str, Set[str]]) -> Optional[List[str]]:
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


# --------------------------------------------------------------------------------------------------------
# The rules


def test_no_import_circle_among_zoo_modules():
    cycle = find_cycle(dependency_edges(all_imports()))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_zoo_import_inside_a_function_except_the_listed_ones():
    inside = [imp for imp in all_imports() if imp.in_function]
    unlisted = sorted({f"{imp.importer}:{imp.line} imports {imp.imported} inside a function" for imp in inside
                       if (imp.importer, imp.imported) not in ALLOWED_IN_FUNCTIONS})
    assert not unlisted, "\n".join(unlisted)
    used = {(imp.importer, imp.imported) for imp in inside}
    stale = [f"{pair}: {why}" for pair, why in ALLOWED_IN_FUNCTIONS.items() if pair not in used]
    assert not stale, "allowed function-level imports that no longer exist (remove them):\n" + "\n".join(stale)


def test_imports_go_down_the_layers():
    wrong = []
    for imp in all_imports():
        here, there = layer_of(imp.importer), layer_of(imp.imported)
        listed = imp.in_function and (imp.importer, imp.imported) in ALLOWED_IN_FUNCTIONS
        if here is not None and there is not None and there > here and not listed:
            wrong.append(f"{imp.importer} ({LAYER_NAMES[here]}) imports {imp.imported} ({LAYER_NAMES[there]}) "
                         f"at line {imp.line}")
    assert not wrong, "\n".join(wrong)


def test_the_deploy_side_imports_nothing_of_the_exporter():
    wrong = [f"{imp.importer}:{imp.line} imports {imp.imported}" for imp in all_imports()
             if imp.importer.startswith(DEPLOY) and not imp.imported.startswith(DEPLOY_MAY_IMPORT)
             or imp.importer.startswith(DEPLOY) and imp.imported.startswith("zoo.policies.")
             and not imp.imported.endswith(".options")]
    assert not wrong, "\n".join(wrong)


def test_importing_the_runner_loads_no_exporter_module():
    """What ``import zoo.runner`` really loads, in a fresh interpreter: no export line, no rewrites, no policy
    unit, and none of lerobot, transformers or diffusers."""
    code = ("import sys, zoo.runner; print(' '.join(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('zoo', 'lerobot', 'transformers', 'diffusers'))))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    assert "zoo.runner" in loaded
    forbidden = [m for m in loaded if m.split(".")[0] != "zoo" or m.startswith(("zoo.export", "zoo.rewrites",
                 "zoo.cli", "zoo.bench")) or (m.startswith("zoo.policies.") and not m.endswith(".options")
                 and m.count(".") > 2)]
    assert not forbidden, forbidden


def program_files() -> List[Path]:
    return sorted(p for folder in PROGRAM_FOLDERS for p in (ROOT / folder).rglob("*.py"))


def importable_names(folder: str) -> Set[str]:
    """What an import of ``folder``'s code would name: the folder itself, or a module of the program folders
    (``import bench_real_size``, run from beside it)."""
    if folder == "tests":
        return {"tests", "conftest", "fixtures", "support"}
    return {folder} | {p.stem for p in program_files()}


def _loads_from(path: Path, folder: str) -> List[str]:
    """How one source file imports from ``folder``: an import statement, or a path into it (``... / "tests"``,
    ``"tests/..."`` handed to ``spec_from_file_location`` or ``sys.path``)."""
    names = importable_names(folder)
    found = []
    for node, _ in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in names:
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            if isinstance(node.right, ast.Constant) and node.right.value == folder:
                found.append(f"line {node.lineno}: a path into {folder}/")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("spec_from_file_location", "insert"):
            if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith(folder + "/")
                   for n in ast.walk(node)):
                found.append(f"line {node.lineno}: a path into {folder}/")
    return found


def _sys_path_uses(path: Path) -> List[str]:
    return [f"line {node.lineno}: sys.path" for node, _ in _walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys"]


def test_programs_import_zoo_only_and_leave_sys_path_alone():
    assert program_files(), "no program found under " + ", ".join(PROGRAM_FOLDERS)
    wrong = {}
    for path in program_files():
        found = _loads_from(path, "tests") + _sys_path_uses(path)
        found += [hit for folder in PROGRAM_FOLDERS for hit in _loads_from(path, folder)]
        if found:
            wrong[path.relative_to(ROOT).as_posix()] = found
    assert not wrong, wrong


def test_tests_load_no_program_and_run_only_the_listed_ones():
    this = Path(__file__).resolve()  # reads the programs as text, loads none of them
    loading = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.resolve() != this:
            found = [hit for folder in PROGRAM_FOLDERS for hit in _loads_from(path, folder)]
            if found:
                loading[path.relative_to(ROOT).as_posix()] = found
    assert set(loading) <= set(TESTS_LOADING_SCRIPTS), {k: v for k, v in loading.items()
                                                        if k not in TESTS_LOADING_SCRIPTS}
    assert set(TESTS_LOADING_SCRIPTS) <= set(loading), "remove the entries of tests that no longer run a program"
    for test, found in loading.items():  # a path handed to the interpreter or bash, never an import
        assert not [hit for hit in found if "import" in hit], (test, found)


def test_the_program_checks_find_an_import_a_path_and_sys_path(tmp_path):
    source = tmp_path / "bench_x.py"
    source.write_text("import sys\nimport bench_real_size\nfrom tests.fixtures import probe\n"
                      "ROOT = Path(__file__).parent / 'scripts'\nsys.path.insert(0, 'tools/x')\n")
    assert _loads_from(source, "benchmarks") == ["line 2: import bench_real_size"]
    assert _loads_from(source, "tests") == ["line 3: from tests.fixtures import ..."]
    assert _loads_from(source, "scripts") == ["line 2: import bench_real_size", "line 4: a path into scripts/"]
    assert _loads_from(source, "tools") == ["line 2: import bench_real_size", "line 5: a path into tools/"]
    assert _sys_path_uses(source) == ["line 5: sys.path"]


def test_no_test_module_imports_another_test_module():
    """What several test modules use lives in a helper module (tests/support, or beside them), never in a test
    module or conftest.py: importing a test module runs its module-level set-up again, and pytest imports it
    under its own name once more."""
    tests = ROOT / "tests"
    test_modules = {p.stem for p in tests.rglob("test_*.py")} | {"conftest"}
    found = {}
    for path in sorted(tests.rglob("*.py")):
        for node, _ in _walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            bad = [n for n in names if set(n.split(".")) & test_modules]
            if bad:
                found.setdefault(path.relative_to(ROOT).as_posix(), []).append(f"line {node.lineno}: {bad[0]}")
    assert not found, found


# --------------------------------------------------------------------------------------------------------
# The checker itself, on hand-made cases


def test_the_checker_finds_a_circle_behind_a_function_level_import(tmp_path):
    edges = dependency_edges([Import("zoo.a", "zoo.b", 1, False), Import("zoo.b", "zoo.c", 3, True),
                              Import("zoo.c", "zoo.a", 2, False)])
    assert find_cycle(edges) == ["zoo.a", "zoo.b", "zoo.c", "zoo.a"]
    # A package's submodule using its sibling is no circle through the package's __init__.
    assert find_cycle(dependency_edges([Import("zoo.p", "zoo.p.x", 1, False),
                                        Import("zoo.p.x", "zoo.p.y", 1, False)])) is None
    # Importing a submodule of another package runs that package's __init__ first.
    assert dependency_edges([Import("zoo.a", "zoo.p.x", 1, False)]) == {"zoo.a": {"zoo.p", "zoo.p.x"}}


def test_the_checker_resolves_relative_and_function_level_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("from . import atomic\nfrom .errors import ZooError\n"
                      "def f():\n    from ..rewrites import result\n    import zoo.core.report\n")
    modules = zoo_modules()
    found = imports_of("zoo.core.mod", source, modules)
    assert [(i.imported, i.in_function) for i in found] == [
        ("zoo.core.atomic", False), ("zoo.core.errors", False), ("zoo.rewrites.result", True), ("zoo.core.report", True)]


def test_every_test_module_has_a_basename_of_its_own():
    # pytest imports test modules by basename (no __init__.py in tests/): two of one name fail the collection.
    names = [p.name for p in sorted((ROOT / "tests").rglob("test_*.py"))]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
