"""LingBot-VA's KV-pool slot bookkeeping on the host: which pool slots a step writes and which it may read.

The export unit takes the slots and the validity mask as inputs (zoo.policies.lingbot_va.pool); the runner
chooses them here, step for step as LeRobot's per-attention cache does.
"""
from __future__ import annotations

from typing import Tuple

import torch

from zoo.core.errors import ZooError


class HostSlotAllocator:
    """The host's slot bookkeeping, step for step the same as LeRobot's per-attention cache.

    It mirrors ``WanAttention.allocate_slots`` / ``_next_cache_id`` / ``update_cache`` / ``restore_cache`` /
    ``clear_pred_cache`` (``lingbot_va/utils.py:562-632``): free slots are taken lowest index first; when too
    few are free, the oldest committed entries (smallest id) are evicted, and an eviction stands even when the
    step does not commit. Every layer of LeRobot's cache makes the same choices, so one allocator serves all.

    Per step: ``slots, visible = alloc.begin(num_tokens)``, run the unit with them, then
    ``alloc.finish(slots, update_cache)`` with LeRobot's ``update_cache`` value: 0 = do not keep (denoising
    steps), 1 = keep as a prediction (last denoising step), 2 = keep as an observation (KV feedback).
    """

    def __init__(self, pool_tokens: int):
        if pool_tokens <= 0:
            raise ZooError(f"a KV pool of {pool_tokens} tokens cannot hold anything",
                           "use host_settings.json's kv_pool.tokens")
        self.pool_tokens = int(pool_tokens)
        self.reset()

    def reset(self) -> None:
        self.mask = torch.zeros(self.pool_tokens, dtype=torch.bool)
        self.ids = torch.full((self.pool_tokens,), -1, dtype=torch.int64)
        self.is_pred = torch.zeros(self.pool_tokens, dtype=torch.bool)

    def begin(self, num_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Choose the step's slots (evicting if needed); return ``(slots int64 [n], visible bool [T_pool])``."""
        free = (~self.mask).nonzero(as_tuple=False).squeeze(-1)
        if free.numel() < num_tokens:
            used = self.mask.nonzero(as_tuple=False).squeeze(-1)
            order = torch.argsort(self.ids[used])
            to_free = used[order[: num_tokens - free.numel()]]
            self.mask[to_free] = False
            self.ids[to_free] = -1
            free = (~self.mask).nonzero(as_tuple=False).squeeze(-1)
        if free.numel() < num_tokens:
            raise ZooError(f"KV pool too small: a step needs {num_tokens} slots, the pool has {self.pool_tokens}",
                           "size the allocator with host_settings.json's kv_pool.tokens and request "
                           "kv_pool.video_slots_per_step / action_slots_per_step per call")
        return free[:num_tokens].clone(), self.mask.clone()

    def finish(self, slots: torch.Tensor, update_cache: int) -> None:
        if update_cache not in (0, 1, 2):
            raise ZooError(f"update_cache must be 0, 1 or 2, got {update_cache}",
                           "0: do not keep the step's K/V, 1: keep as a prediction, 2: keep as an observation")
        new_id = self.ids[self.mask].max() + 1 if bool(self.mask.any()) else torch.tensor(0)
        self.ids[slots] = new_id
        self.is_pred[slots] = update_cache == 1
        self.mask[slots] = update_cache != 0

    def clear_predictions(self) -> None:
        """LeRobot's ``clear_pred_cache``: forget entries committed as predictions (before KV feedback)."""
        self.mask[self.is_pred] = False
