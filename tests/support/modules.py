"""Small modules shared by several test modules."""

from __future__ import annotations

import torch
from torch import nn


class ToyPermuted(nn.Module):
    """Uses its inputs in the order c, b, a: the partition's first-use order puts them in the .so that way."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.proj(c) * b + a


class PoolWrite(nn.Module):
    """The io KV-pool protocol in miniature: write rows at slots, return a readout and the new pool (the
    ExecuTorch session, the C++ runner, the runtime check)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, values, slots, pool):
        new = pool.index_copy(0, slots, values * self.scale)
        return new.sum(1), new
