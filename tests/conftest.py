"""Shared test setup.

Every test session runs with no network and never touches the user's caches: HF_HUB_OFFLINE=1, and
HF_HUB_CACHE and zoo's tiny-checkpoint cache point into a throw-away folder (set before anything imports
huggingface_hub, which reads them at import; subprocesses inherit them).

Also here: a toy policy family (``family: toy``; the ``toy_family`` fixture) so the pipeline, hub and CLI can be
tested end to end without lerobot. It is found as ``zoo.policies.toy`` like a shipped family: tests/families
(``toy/unit.py``, ``toy/options.py``) is added to zoo.policies' search path below. It builds a tiny Meta-style
complex-rotary attention ("rope" kind) or a two-method unit sharing a mutable pool buffer written with
``index_copy_`` ("pool" kind, LingBot's KV-pool protocol in miniature).
Its checkpoint has the real layout (config.json + model.safetensors + a processor file) and it loads
strictly, raising zoo errors for a wrong model type or missing/mismatched weights as the real families do.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict

import pytest

# A subprocess that imports this module (the fault-injection children, tests/fault_injection.py) shares the
# session's sandbox. Under pytest-xdist each worker is a session of its own with its own sandbox (its caches
# are written by its tests only), not the controller's it inherits.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_OWN_SANDBOX = "ZOO_TEST_SANDBOX" not in os.environ or os.environ.get("ZOO_TEST_SANDBOX_WORKER") != _WORKER
_SANDBOX = Path(tempfile.mkdtemp(prefix="zoo-tests-") if _OWN_SANDBOX else os.environ["ZOO_TEST_SANDBOX"])
os.environ["ZOO_TEST_SANDBOX"] = str(_SANDBOX)
os.environ["ZOO_TEST_SANDBOX_WORKER"] = _WORKER
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = str(_SANDBOX / "hf-cache")
os.environ["ZOO_TINY_HUB_CACHE"] = str(_SANDBOX / "tiny-hub")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import zoo.policies  # noqa: E402
from zoo.core.errors import PullError  # noqa: E402
from zoo.policies.base import ExportUnit, InputSpec, MethodSpec  # noqa: E402

TEST_RECIPES = Path(__file__).resolve().parent / "recipes"
TEST_FAMILIES = Path(__file__).resolve().parent / "families"
# The toy family, by zoo's convention: zoo.policies.toy.unit and zoo.policies.toy.options (tests/families/toy).
zoo.policies.__path__.append(str(TEST_FAMILIES))
TOY_MODEL_TYPE = "zoo_toy"


# --------------------------------------------------------------------------------------------------------
# Running in parallel (pytest-xdist; pyproject.toml's addopts ask for ``-n auto``)

# Scheduled first, the longest first, each as one unit: the session is as long as its longest worker, and a
# long module started last would run alone at the end. Every other module follows in collection order.
LONGEST_FIRST = ("tests/test_faults.py", "tests/runner/test_lingbot_va_runner.py",
                 "tests/runner/test_fast_wam_runner.py", "tests/test_cli.py", "tests/test_lowering_workers.py")
# Modules that share a session fixture run on one worker, so that it is built once:
# conftest.llama_tiny_readme_run (the README's main job) is checked by both of these.
SAME_WORKER = {"tests/test_readme.py": "tests/test_cli.py"}
MAX_WORKERS = 4  # 24 GiB of memory: each worker may hold a tiny LeRobot policy and a lowering at once


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core this process may run on, at most MAX_WORKERS."""
    return max(1, min(_cores(), MAX_WORKERS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole modules to a worker (their module-scoped fixtures are built once), the longest first."""
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}

    class LongestFirst(OrderedDict):
        """The work queue: the next unit handed out is the best-ranked one, else the first queued."""

        def popitem(self, last=True):
            scope = min(self, key=lambda s: rank.get(s, len(rank)))
            return scope, self.pop(scope)

    class ModuleScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = LongestFirst()

        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return SAME_WORKER.get(module, module)

    return ModuleScheduling(config, log)


def _threads_per_worker() -> None:
    """Under xdist, the cores shared out between the workers: torch's own thread pool (and a subprocess's, through
    OMP_NUM_THREADS) gets its share, so that workers do not spin on each other's cores."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not _WORKER or count < 1:
        return
    threads = max(1, _cores() // count)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_threads_per_worker()


@pytest.fixture(autouse=True)
def zoo_logging_as_a_fresh_process_has_it():
    """Each test starts with the "zoo" logger as a fresh process has it, whichever tests its worker ran before:
    a command's main (``zoo.core.progress.setup_logging``) takes it off the root logger, where ``caplog`` listens,
    for the rest of the process."""
    import logging

    from zoo.core import progress

    logger = logging.getLogger("zoo")
    saved = (list(logger.handlers), logger.level, logger.propagate, progress.setup_logging.__dict__.copy())
    # As a fresh process has it, not as found: a session or module fixture set up before this one (the README's
    # main job, run in this process) may already have run a command's main.
    logger.handlers[:] = []
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    progress.setup_logging.__dict__.pop("_done", None)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
    progress.setup_logging.__dict__.clear()
    progress.setup_logging.__dict__.update(saved[3])


# --------------------------------------------------------------------------------------------------------
# The fault-injection table (tests/test_faults.py)

FAULT_ROWS = []  # (case index, row) of each fault case, as the reports bring them (from the workers under xdist)


def pytest_runtest_logreport(report):
    if report.when == "call":
        FAULT_ROWS.extend(value for name, value in report.user_properties if name == "fault_row")


def pytest_terminal_summary(terminalreporter):
    """The fault-injection table at the end of the session, and as JSON lines where ZOO_FAULT_TABLE names a file
    (tools/fault_table.py)."""
    if not FAULT_ROWS or hasattr(terminalreporter.config, "workerinput"):
        return
    import fault_injection

    rows = [row for _, row in sorted(FAULT_ROWS, key=lambda item: item[0])]
    terminalreporter.write_sep("=", f"fault injection: {len(rows)} cases")
    terminalreporter.write_line(fault_injection.markdown_table(rows))
    if os.environ.get("ZOO_FAULT_TABLE"):
        fault_injection.write_table_rows(Path(os.environ["ZOO_FAULT_TABLE"]), rows)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_SANDBOX:
        shutil.rmtree(_SANDBOX, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------
# The toy family


class ToyRope(nn.Module):
    """Causal self-attention with Meta's complex rotary embedding: a complex64 table sliced to the length."""

    def __init__(self, dim: int, heads: int, max_seq: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        b, length, h, d = x.shape
        xc = torch.view_as_complex(x.float().reshape(b, length, h, d // 2, 2))
        freqs = self.freqs_cis[:length].view(1, length, 1, d // 2)
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, dim = x.shape
        shape = (b, length, self.heads, self.head_dim)
        q = self.rotate(self.wq(x).view(shape)).transpose(1, 2)
        k = self.rotate(self.wk(x).view(shape)).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, length, dim))


class ToyPermuted(nn.Module):
    """Uses its inputs in the order c, b, a: the partition's first-use order puts them in the .so that way."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.proj(c) * b + a


class ToyPool(nn.Module):
    """A pool of ``slots`` rows shared by two methods: ``write`` stores projected rows at host-chosen slots
    (in place, like LingBot's KV pool), ``read`` attends over the whole pool."""

    def __init__(self, dim: int, slots: int):
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.register_buffer("pool", torch.zeros(slots, dim), persistent=False)  # zero state, not a weight


class ToyWrite(nn.Module):
    def __init__(self, core: ToyPool):
        super().__init__()
        self.core = core

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self.core.pool.index_copy_(0, slots, self.core.wk(x))
        return self.core.pool.sum(dim=0)


class ToyRead(nn.Module):
    def __init__(self, core: ToyPool):
        super().__init__()
        self.core = core

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        scores = self.core.wq(q) @ self.core.pool.t()
        return torch.softmax(scores, dim=-1) @ self.core.pool


def toy_weight_shapes(config: Dict) -> Dict[str, tuple]:
    dim = config["dim"]
    names = ("wq", "wk", "wv", "wo") if config["kind"] == "rope" else ("wq", "wk")
    prefix = "" if config["kind"] == "rope" else "core."
    return {f"{prefix}{n}.weight": (dim, dim) for n in names}


class ToyFamily:
    """The toy family's two functions (tests/families/toy/unit.py makes them zoo.policies.toy.unit.s)."""

    @staticmethod
    def fabricate_checkpoint(recipe, work_dir: Path) -> Dict[str, Path]:
        from safetensors.torch import save_file

        opts = recipe.unit.options  # ToyOptions
        config = {"model_type": TOY_MODEL_TYPE, "kind": opts.kind, "dim": opts.dim, "heads": opts.heads,
                  "slots": opts.slots}
        g = torch.Generator().manual_seed(int(recipe.source.seed))
        folder = Path(work_dir) / "policy"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        tensors = {name: torch.randn(shape, generator=g) / shape[1] ** 0.5
                   for name, shape in sorted(toy_weight_shapes(config).items())}
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "policy_preprocessor.json").write_text(json.dumps({"name": "toy", "steps": []}))
        # An auxiliary repo the policy would load by id (like Fast-WAM's VAE), to show it lands in the cache.
        aux = Path(work_dir) / "aux"
        aux.mkdir()
        (aux / "config.json").write_text(json.dumps({"what": "toy auxiliary repo"}))
        return {recipe.source.repo_id: folder, "toy-org/toy-aux": aux}

    @staticmethod
    def check_recipe(recipe) -> None:
        from zoo.core.errors import RecipeError

        methods = ["forward"] if recipe.unit.options.kind == "rope" else ["write", "read"]
        if list(recipe.unit.methods) != methods:
            raise RecipeError(f"recipe {recipe.name!r}: unit.methods={list(recipe.unit.methods)}; a toy "
                              f"{recipe.unit.options.kind} unit has {methods}", f"set unit.methods: {methods}")

    @staticmethod
    def build_unit(checkpoint_dir: Path, recipe) -> ExportUnit:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        checkpoint_dir = Path(checkpoint_dir)
        if recipe.unit.options.load_aux:
            # Like Fast-WAM's VAE: a repo the policy loads by Hub id, through whatever cache is configured.
            from huggingface_hub import snapshot_download

            json.loads((Path(snapshot_download("toy-org/toy-aux")) / "config.json").read_text())
        config = json.loads((checkpoint_dir / "config.json").read_text())
        if config.get("model_type") != TOY_MODEL_TYPE:
            raise PullError(f"{checkpoint_dir} is a {config.get('model_type')!r} checkpoint, not {TOY_MODEL_TYPE!r}",
                            "point the recipe at a toy checkpoint")
        try:
            state = load_file(str(checkpoint_dir / "model.safetensors"))
        except (SafetensorError, OSError) as exc:
            raise PullError(f"{checkpoint_dir}/model.safetensors cannot be read: {exc}", "re-download it") from exc
        dim = config["dim"]
        dtype = getattr(torch, recipe.unit.dtype)
        if config["kind"] == "rope":
            module = ToyRope(dim, config["heads"], max_seq=recipe.dynamic["seq"].max)
        else:
            module = ToyPool(dim, config["slots"])
        try:
            module.load_state_dict({k.replace("core.", "", 1): v for k, v in state.items()}, strict=True)
        except RuntimeError as exc:
            raise PullError(f"{checkpoint_dir}: weights do not match the toy model: {' '.join(str(exc).split())}",
                            "use a checkpoint of this recipe") from exc
        # Module.to(dtype) would also cast the complex table (dropping its imaginary part): cast real tensors only.
        module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
        module.eval()
        float_dtype = recipe.unit.dtype
        files = [checkpoint_dir / "policy_preprocessor.json"]
        if config["kind"] == "rope":
            methods = {"forward": MethodSpec("forward", module, [InputSpec("x", float_dtype, [1, "seq", dim])], ["y"])}
        else:
            slots = config["slots"]
            methods = {
                "write": MethodSpec("write", ToyWrite(module),
                                    [InputSpec("x", float_dtype, [2, dim]),
                                     InputSpec("slots", "int64", [2], f"randperm:{slots}")], ["pool_sum"]),
                "read": MethodSpec("read", ToyRead(module), [InputSpec("q", float_dtype, [3, dim])], ["out"]),
            }
        return ExportUnit(family="toy", methods=methods, host_settings={"steps": 4, "shift": 1.5},
                          host_files=files)


@pytest.fixture
def toy_family():
    """The toy family module, loaded as the pipeline loads it (the test recipes say family: toy)."""
    return zoo.policies.load_family("toy")


@pytest.fixture
def test_recipe():
    """Load a recipe from tests/recipes by name, with overrides."""
    from zoo.contract.recipes import load_recipe

    def load(name: str, *overrides: str):
        return load_recipe(name, overrides, recipes_dir=TEST_RECIPES)

    return load


# --------------------------------------------------------------------------------------------------------
# A zoo_runner for CPU tests: tests/fixtures/fake_zoo_runner.py (the runner's command line and file format,
# running the run folder's exported programs eagerly)

FAKE_ZOO_RUNNER = Path(__file__).resolve().parent / "fixtures" / "fake_zoo_runner.py"


@pytest.fixture(scope="session")
def fake_zoo_runner(tmp_path_factory) -> Path:
    """An executable wrapper around the fake (the real runner is a binary: the session execs it directly)."""
    import stat
    import sys

    path = tmp_path_factory.mktemp("bin") / "zoo_runner"
    path.write_text(f"#!/bin/sh\nPYTHONPATH='{os.pathsep.join(sys.path)}' exec {sys.executable} {FAKE_ZOO_RUNNER} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# A fresh clone, as the README's commands expect one (tests/test_readme.py, tests/test_cli.py)

REPO_ROOT = Path(__file__).resolve().parent.parent
CLONE_ENTRIES = ("zoo", "recipes", "scripts", "pyproject.toml", "README.md")


@pytest.fixture(scope="session")
def readme_clone(tmp_path_factory) -> Path:
    """A folder laid out like a fresh clone after ``scripts/setup.sh``: the repository's files (linked) and
    ``.venv`` (the venv running these tests). Commands run in it exactly as the README writes them."""
    import sys as _sys

    clone = tmp_path_factory.mktemp("clone")
    for name in CLONE_ENTRIES:
        (clone / name).symlink_to(REPO_ROOT / name)
    venv = REPO_ROOT / ".venv" if (REPO_ROOT / ".venv" / "bin" / "activate").exists() else Path(_sys.prefix)
    (clone / ".venv").symlink_to(venv)
    return clone


def run_in_clone(clone: Path, command: str, activate: bool, timeout: int = 900):
    """Run a README command in ``clone`` with bash (after ``source .venv/bin/activate`` when the README says
    the venv is active)."""
    import subprocess

    script = ("source .venv/bin/activate && " if activate else "") + command
    env = dict(os.environ, PYTHONPATH=str(clone))  # `zoo` is the clone's, whatever the venv has installed
    return subprocess.run(["bash", "-c", script], cwd=clone, capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture(scope="session")
def llama_tiny_readme_run(readme_clone):
    """The README's main job, run once per session as written: ``.venv/bin/python -m zoo.export llama-rope-tiny``
    (tests/test_readme.py runs the README's commands, tests/test_cli.py checks the run it leaves)."""
    pytest.importorskip("transformers")
    proc = run_in_clone(readme_clone, ".venv/bin/python -m zoo.export llama-rope-tiny", activate=False)
    return proc, readme_clone / "runs" / "llama-rope-tiny"
