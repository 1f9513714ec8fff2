"""Which runtimes verification runs the shipped artifact on, and the ExecuTorch one's caller.

- ``aoti``: each method's ``.so`` + weights blob through torch's AOTI runner (zoo.aoti_runner), fed in the
  ``.so``'s own input order; libtorch's shims.
- ``executorch``: ``model.pte`` + ``aoti_cuda_blob.ptd`` through ExecuTorch's C++ runtime and its CUDA backend
  (zoo_runner, zoo.et_runtime), fed in the method's signature order; ExecuTorch's shims, what a deployment runs.

``select_runtimes`` reads the choice (recipe key ``verify.runtimes`` or a command line flag): ``aoti``,
``executorch``, ``both``, or a list of names. ``executorch_caller`` opens one runtime session for a run folder
and gives ``call(method, inputs) -> outputs``, both in the method's order, on ``device``, the shape
verification's comparison loop takes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .errors import RecipeError
from .et_runtime import RuntimeSession, describe

RUNTIMES = ("aoti", "executorch")
ALIASES = {"both": RUNTIMES, "all": RUNTIMES}

Call = Callable[[str, List[torch.Tensor]], List[torch.Tensor]]


def select_runtimes(choice: Union[str, Sequence[str]]) -> Tuple[str, ...]:
    """The runtimes to verify on, in a fixed order (aoti first), from ``aoti``/``executorch``/``both`` or a list."""
    items = [choice] if isinstance(choice, str) else list(choice)
    chosen = set()
    for item in items:
        for name in ALIASES.get(item, (item,)):
            if name not in RUNTIMES:
                raise RecipeError(f"unknown verification runtime {item!r}",
                                  f"choose from {', '.join(RUNTIMES)} or both")
            chosen.add(name)
    if not chosen:
        raise RecipeError("no verification runtime chosen", f"choose from {', '.join(RUNTIMES)} or both")
    return tuple(name for name in RUNTIMES if name in chosen)


@contextlib.contextmanager
def executorch_caller(pte: Path, ptd: Optional[Path], methods: Sequence[str], device: str, *,
                      executable: Optional[Union[str, Path]] = None,
                      require_cuda: bool = True) -> Iterator[Tuple[str, Call]]:
    """One loaded program in ExecuTorch's C++ runtime; yields (a line saying which runtime, ``call``).

    ``call`` takes the inputs in the method's signature order (never the ``.so``'s: the runtime reorders) and
    returns the tensor outputs on ``device``. Stateful methods keep their state across calls, as in
    verification's AOTI runners."""
    with RuntimeSession(pte, ptd if ptd is not None and Path(ptd).exists() else None, executable=executable,
                        require_cuda=require_cuda, methods=methods) as session:

        def call(method: str, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
            return [t.to(device) for t in session.call(method, inputs)]

        yield describe(session.build), call
