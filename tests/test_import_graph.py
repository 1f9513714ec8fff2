"""zoo's imports run one way: errors/atomic/report -> run_folder/artifact/runtimes -> steps -> pipeline -> command
lines. Read with ``ast`` from the source (nothing is imported), so a circle that only shows at run time, behind an
import inside a function, is found too:
  - no import circle among zoo's modules;
  - no import of a zoo module inside a function body, except the ones listed below, each with its reason;
  - no module imports one of a higher layer;
  - scripts/ and tests/ do not import from each other.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "zoo"

# Imports of a zoo module inside a function body that are allowed: (importer, imported) -> why.
# A zoo module may be imported inside a function only to keep lerobot or a GPU-only dependency optional.
# Entries marked "pending: <branch>" belong to modules another branch is restructuring; the coordinator removes
# them once that branch is merged (the test fails on an entry that no longer matches any import).
ALLOWED_IN_FUNCTIONS: Dict[Tuple[str, str], str] = {
    ("zoo.recipes", "zoo.rewrites"): "pending: recipe validation of rewrite names (zoo.rewrites imports nothing "
                                     "of the recipes, so this can move to the top)",
}

# The layers of the modules this order is about; an import may go to the same layer or a lower one. Modules
# not listed (the families, the rewrites, the bench) are held to the first two rules only.
LAYERS: Dict[str, int] = {
    **dict.fromkeys(["zoo", "zoo.errors", "zoo.atomic", "zoo.report", "zoo.progress", "zoo.environ",
                     "zoo.numerics", "zoo.sampling_profiler"], 0),
    **dict.fromkeys(["zoo.run_folder", "zoo.artifact", "zoo.assemble", "zoo.runtimes", "zoo.tensor_file",
                     "zoo.chunk_latency", "zoo.gpu_targets"], 1),
    **dict.fromkeys(["zoo.hub", "zoo.hub_cache", "zoo.tiny_hub", "zoo.exporting", "zoo.cpu_check", "zoo.preflight",
                     "zoo.lowering", "zoo.lowering_workers", "zoo.lowering_target", "zoo.constant_plan", "zoo.audit",
                     "zoo.verify",
                     "zoo.aoti_runner", "zoo.et_runtime", "zoo.verify_backends", "zoo.runtime_check", "zoo.manifest",
                     "zoo.model_card", "zoo.publishing", "zoo.gpu_steps",
                     "zoo.policy_check", "zoo.runner", "zoo.runner.base", "zoo.runner.backends", "zoo.runner.check",
                     "zoo.runner.fast_wam", "zoo.runner.lingbot_va", "zoo.runner.loading", "zoo.runner.observations",
                     "zoo.runner.processors", "zoo.runner.prompt"], 2),
    "zoo.pipeline": 3,
    **dict.fromkeys(["zoo.export", "zoo.lower", "zoo.publish", "zoo.__main__", "zoo.cli", "zoo.doctor",
                     "zoo.bundle", "zoo.deploy"], 4),
}
LAYER_NAMES = ("errors/atomic/report", "run_folder/artifact/runtimes", "steps", "pipeline", "command lines")

# Test modules that still load a script (pending: the branch that owns them).
TESTS_LOADING_SCRIPTS = {
    "tests/test_bench.py": "pending: i16-bench (parse_unit of bench_real_size)",
    "tests/test_gpu_jobs.py": "runs scripts/gpu_jobs.sh as a program (bash); no Python is loaded from scripts/",
    "tests/policies/test_bench_chunk_seeded.py": "runs scripts/bench_chunk.py as a program (the real-size weights "
                                                 "path at tiny size); no Python is loaded from scripts/",
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
    modules = zoo_modules()
    assert not set(LAYERS) - set(modules), f"layer map names modules that do not exist: {set(LAYERS) - set(modules)}"
    wrong = [f"{imp.importer} ({LAYER_NAMES[LAYERS[imp.importer]]}) imports {imp.imported} "
             f"({LAYER_NAMES[LAYERS[imp.imported]]}) at line {imp.line}"
             for imp in all_imports()
             if imp.importer in LAYERS and imp.imported in LAYERS and LAYERS[imp.imported] > LAYERS[imp.importer]]
    assert not wrong, "\n".join(wrong)


IMPORTABLE = {"scripts": {"scripts"}, "tests": {"tests", "conftest", "fixtures"}}


def _loads_from(path: Path, folder: str) -> List[str]:
    """How one source file imports from ``folder``: an import statement, or a path into it (``... / "tests"``,
    ``"tests/..."`` handed to ``spec_from_file_location`` or ``sys.path``)."""
    found = []
    for node, _ in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in IMPORTABLE[folder]]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in IMPORTABLE[folder]:
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            if isinstance(node.right, ast.Constant) and node.right.value == folder:
                found.append(f"line {node.lineno}: a path into {folder}/")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("spec_from_file_location", "insert"):
            if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith(folder + "/")
                   for n in ast.walk(node)):
                found.append(f"line {node.lineno}: a path into {folder}/")
    return found


def test_scripts_and_tests_do_not_import_each_other():
    from_scripts = {p.relative_to(ROOT).as_posix(): _loads_from(p, "tests") for p in (ROOT / "scripts").glob("*.py")}
    assert not {k: v for k, v in from_scripts.items() if v}
    this = Path(__file__).resolve()  # reads the scripts as text, loads none of them
    from_tests = {p.relative_to(ROOT).as_posix(): _loads_from(p, "scripts") for p in (ROOT / "tests").rglob("*.py")
                  if p.resolve() != this}
    loading = {k: v for k, v in from_tests.items() if v}
    assert set(loading) <= set(TESTS_LOADING_SCRIPTS), {k: v for k, v in loading.items()
                                                        if k not in TESTS_LOADING_SCRIPTS}
    assert set(TESTS_LOADING_SCRIPTS) <= set(loading), "remove the entries of tests that no longer load a script"


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
                      "def f():\n    from .rewrites import result\n    import zoo.report\n")
    modules = zoo_modules()
    found = imports_of("zoo.mod", source, modules)
    assert [(i.imported, i.in_function) for i in found] == [
        ("zoo.atomic", False), ("zoo.errors", False), ("zoo.rewrites.result", True), ("zoo.report", True)]
