"""Small modules shared by the runtime tests (the ExecuTorch session, the C++ runner, the runtime check)."""

from __future__ import annotations

from torch import nn


class PoolWrite(nn.Module):
    """The io KV-pool protocol in miniature: write rows at slots, return a readout and the new pool."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, values, slots, pool):
        new = pool.index_copy(0, slots, values * self.scale)
        return new.sum(1), new
