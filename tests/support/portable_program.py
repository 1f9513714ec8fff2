"""A small three-method program with portable kernels only and its weights in a .ptd, as zoo_runner and the
in-process session load a CUDA artifact: ``gather`` (float32 weights, int64 indices, a bool mask) and the io
KV-pool protocol in miniature (``video_step``/``action_step``). The reference is the eager module."""

from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import torch
from torch import nn

from support.modules import PoolWrite


class Gather(nn.Module):
    """float32 weights (external constants -> .ptd), int64 indices and a bool mask, in that order."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, idx, mask):
        return self.lin(x[idx]) * mask.unsqueeze(-1).to(x.dtype), idx * 2


def modules() -> dict:
    torch.manual_seed(0)
    return {"gather": Gather().eval(), "video_step": PoolWrite(1.0), "action_step": PoolWrite(-2.0)}


def build(folder: Path, mods: dict) -> Tuple[Path, Path]:
    """Exports ``mods`` to FOLDER/model.pte and one .ptd; returns both paths."""
    from executorch.exir import ExecutorchBackendConfig, to_edge

    from zoo.contract.artifact import ensure_flatc

    ensure_flatc()  # writing a .pte needs flatc
    torch.manual_seed(0)
    examples = {"gather": (torch.randn(5, 4), torch.tensor([0, 3, 1]), torch.tensor([True, False, True])),
                "video_step": (torch.randn(2, 4), torch.tensor([1, 3]), torch.zeros(5, 4))}
    examples["action_step"] = examples["video_step"]
    eps = {m: torch.export.export(mods[m], examples[m]) for m in mods}
    prog = to_edge(eps).to_executorch(ExecutorchBackendConfig(external_constants=True))
    (folder / "model.pte").write_bytes(prog.buffer)
    prog.write_tensor_data_to_file(str(folder))
    ptds = list(folder.glob("*.ptd"))
    assert len(ptds) == 1, "the weights should have gone to one .ptd"
    return folder / "model.pte", ptds[0]


def gather_inputs(seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 4, generator=g), torch.randint(0, 5, (3,), generator=g), torch.rand(3, generator=g) > 0.4]


def pool_calls(n: int, seed: int = 21):
    g = torch.Generator().manual_seed(seed)
    return [(("video_step", "action_step")[i % 2], torch.randn(2, 4, generator=g), torch.randperm(5, generator=g)[:2])
            for i in range(n)]


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # portable kernels and ATen may round a 4-term dot product differently; relative L2 within float32 eps
    return got.dtype == want.dtype and got.shape == want.shape and bool(
        torch.linalg.vector_norm((got - want).double()) <= 1e-6 * torch.linalg.vector_norm(want.double()))
