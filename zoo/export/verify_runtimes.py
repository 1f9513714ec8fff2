"""Which runtimes verification runs the shipped artifact on (``aoti``: torch's AOTI runner over each ``.so``;
``executorch``: ExecuTorch's C++ runtime over ``model.pte`` + ``.ptd``), chosen from ``verify.runtimes`` before
any work, and the ExecuTorch runtime's caller (docs/ARCHITECTURE.md, "Audit and verification").
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from zoo.core.environ import environ_restored
from zoo.core.errors import RecipeError, RuntimeNotBuilt
from zoo.runtimes.executorch import BUILD_HINT, RUNNER_ENV, RuntimeSession, describe, find_runner, runner_info
from zoo.contract.recipes import VERIFY_RUNTIMES
from zoo.contract.releases import RuntimeRequirement

ALIASES = {"both": VERIFY_RUNTIMES}
LABELS = {"aoti": "torch's AOTI runner", "executorch": "ExecuTorch runtime"}

Call = Callable[[str, List[torch.Tensor]], List[torch.Tensor]]


def select_runtimes(choice: Union[str, Sequence[str]]) -> Tuple[str, ...]:
    """The runtimes to verify on, in a fixed order (aoti first), from ``aoti``/``executorch``/``both`` or a list."""
    items = [choice] if isinstance(choice, str) else list(choice)
    chosen = set()
    for item in items:
        for name in ALIASES.get(item, (item,)):
            if name not in VERIFY_RUNTIMES:
                raise RecipeError(f"unknown verification runtime {item!r}",
                                  f"choose from {', '.join(VERIFY_RUNTIMES)} or both")
            chosen.add(name)
    if not chosen:
        raise RecipeError("no verification runtime chosen", f"choose from {', '.join(VERIFY_RUNTIMES)} or both")
    return tuple(name for name in VERIFY_RUNTIMES if name in chosen)


@dataclass
class RuntimeChoice:
    """What verification will run: the runtimes, the zoo_runner for the ExecuTorch one and its ``--info``."""

    runtimes: Tuple[str, ...]
    explicit: bool  # chosen by the recipe or the command line, not the default
    runner: Optional[Path] = None
    runner_info: Dict[str, Any] = field(default_factory=dict)
    left_out: Dict[str, str] = field(default_factory=dict)  # runtime -> why the default choice left it out

    def notes(self) -> List[str]:
        return [f"{LABELS[name]}: not run ({why})" for name, why in self.left_out.items()]


def choose_runtimes(setting: Optional[Sequence[str]], executable: Optional[Union[str, Path]] = None) -> RuntimeChoice:
    """Resolve ``verify.runtimes`` against this machine. A choice that names ``executorch`` needs a zoo_runner
    built with the CUDA backend (``RuntimeNotBuilt`` otherwise); the default leaves it out with a note."""
    explicit = setting is not None
    runtimes = select_runtimes(setting if explicit else "both")
    if "executorch" not in runtimes:
        return RuntimeChoice(runtimes, explicit)
    try:
        runner = find_runner(executable)
        info = runner_info(runner)
        if not info.get("cuda"):
            raise RuntimeNotBuilt(f"{runner} was built without the CUDA backend (portable runtime only); it cannot "
                                  "run a CUDA artifact", "build without --cpu: " + BUILD_HINT)
    except RuntimeNotBuilt as exc:
        if explicit:
            raise
        why = f"{exc.message}; build one with scripts/build_runtime.sh (docs/runtime.md)"
        return RuntimeChoice(tuple(r for r in runtimes if r != "executorch"), explicit, left_out={"executorch": why})
    return RuntimeChoice(runtimes, explicit, runner=runner, runner_info=info)


@contextlib.contextmanager
def executorch_caller(pte: Path, ptd: Optional[Path], methods: Sequence[str], device: str, *,
                      executable: Optional[Union[str, Path]] = None, require_cuda: bool = True,
                      requirement: Optional[RuntimeRequirement] = None) -> Iterator[Tuple[Dict[str, Any], Call]]:
    """One loaded program in ExecuTorch's C++ runtime; yields (what loaded it, ``call``).

    The first is ``describe`` (one line naming the runtime build), ``executorch_version``, ``load_ms``,
    ``gpu_loaded_mib`` (GPU memory the loaded program took) and ``gpu``. ``call`` takes the inputs in the
    method's signature order (never the ``.so``'s: the runtime reorders) and returns the tensor outputs on
    ``device``. Stateful methods keep their state across calls, as in verification's AOTI runners. With
    ``requirement`` (the run's ``runtime.json``), a runner of another release is refused (``RuntimeMismatch``)."""
    with RuntimeSession(pte, ptd if ptd is not None and Path(ptd).exists() else None, executable=executable,
                        require_cuda=require_cuda, methods=methods, requirement=requirement) as session:

        def call(method: str, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
            return [t.to(device) for t in session.call(method, inputs)]

        loaded = {"describe": describe(session.build),
                  "executorch_version": session.build.get("executorch_version"),
                  **{k: session.ready.get(k) for k in ("load_ms", "gpu_loaded_mib", "gpu")}}
        yield loaded, call


# --- the command lines' flags ----------------------------------------------------------------------------------------


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """``--runtime`` and ``--et-runner`` for ``python -m zoo.export`` and ``python -m zoo lower``."""
    parser.add_argument("--runtime", choices=VERIFY_RUNTIMES + ("both",), default=None,
                        help="verify on torch's AOTI runner, ExecuTorch's C++ runtime, or both (sets "
                             "verify.runtimes; default: both, the ExecuTorch runtime where a zoo_runner is found)")
    parser.add_argument("--et-runner", metavar="PATH", default=None,
                        help=f"the zoo_runner executable (default: ${RUNNER_ENV}; build it with "
                             "scripts/build_runtime.sh, docs/runtime.md)")


def runtime_overrides(args: argparse.Namespace) -> List[str]:
    """The recipe override ``--runtime`` stands for (none without it)."""
    if args.runtime is None:
        return []
    return [f"verify.runtimes=[{','.join(select_runtimes(args.runtime))}]"]


@contextlib.contextmanager
def runner_from_arguments(args: argparse.Namespace) -> Iterator[None]:
    """``--et-runner PATH`` is ``$ZOO_ET_RUNNER`` for the command; a path that is no runner is refused at once."""
    if args.et_runner is None:
        yield
        return
    runner = find_runner(args.et_runner)
    with environ_restored([RUNNER_ENV]):
        os.environ[RUNNER_ENV] = str(runner.resolve())
        yield
