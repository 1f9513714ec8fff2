"""LingBot-VA's export unit core: one DiT step over an explicit KV pool, and the host's slot allocator.

LeRobot's ``WanAttention`` keeps its KV cache in Python dicts and picks slots with ``nonzero`` and
data-dependent eviction (``lingbot_va/utils.py:585-632``), which ``torch.export`` cannot trace. Here the cache
becomes a fixed, zero-initialised pool ``[layers, B, T_pool, heads, head_dim]``: each step writes its new K/V
with ``index_copy_`` at slots the host chose and attends over the whole pool under a bool mask. This equals
LeRobot's attention over ``[valid slots] ∪ [new tokens]`` because softmax is permutation invariant over keys
and a masked key contributes exactly zero, as long as masked slots hold finite values (hence zeros, never
``torch.empty``). RoPE is applied to K before it is stored, in both.

The DiT itself is LeRobot's ``WanTransformer3DModel``, called unchanged; only each self-attention's
``attn_op`` is swapped for the pool attention during a call. This module needs torch only (no lerobot), so a
deploy host can import ``HostSlotAllocator`` on its own.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..errors import ZooError

KV_POOL_LAYOUTS = ("io", "buffer")
# A cache name no LeRobot attention holds, so WanAttention.forward skips its own cache path entirely.
_NO_EAGER_CACHE = "zoo_kv_pool"


class _StepCall:
    """What one step's self-attentions share: slots to write, the attention mask, and the pools."""

    def __init__(self, slots: torch.Tensor, visible: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 in_place: bool):
        self.slots = slots
        self.k_pool = k_pool
        self.v_pool = v_pool
        self.in_place = in_place
        # The new tokens see every visible slot plus their own slots, which is what LeRobot's cache does:
        # it writes the new K/V first and then gathers every valid slot (utils.py:656-666).
        self.keys_visible = visible.index_copy(0, slots, torch.ones_like(slots, dtype=torch.bool))
        self.k_layers: List[torch.Tensor] = []
        self.v_layers: List[torch.Tensor] = []


class PoolStep(torch.nn.Module):
    """One DiT step of one stream (video or action) over an explicit KV pool.

    ``transformer`` is LeRobot's ``WanTransformer3DModel`` (shared between the video and action units).
    Layout ``"io"``: ``forward(noisy_latents, timesteps, grid_id, text_emb, slots, visible, k_pool, v_pool) ->
    (pred, k_pool_next, v_pool_next)``. Layout ``"buffer"``: the pools are this module's buffers, updated in
    place, and ``forward(noisy_latents, timesteps, grid_id, text_emb, slots, visible) -> pred``.

    ``slots``: int64 ``[L]``, distinct pool indices receiving this step's K/V. ``visible``: bool ``[T_pool]``,
    the slots holding valid K/V from earlier steps (the new slots are added by the unit itself).
    """

    def __init__(self, transformer: torch.nn.Module, action_mode: bool, kv_pool: str,
                 shared_pools: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        super().__init__()
        if kv_pool not in KV_POOL_LAYOUTS:
            raise ValueError(f"kv_pool must be one of {KV_POOL_LAYOUTS}, got {kv_pool!r}")
        if (kv_pool == "buffer") != (shared_pools is not None):
            raise ValueError("the 'buffer' layout needs shared_pools (k, v); the 'io' layout takes none")
        self.transformer = transformer
        self.action_mode = bool(action_mode)
        self.kv_pool = kv_pool
        if shared_pools is not None:
            # The same tensors are registered in both streams' units, so eager calls share one pool the way
            # LeRobot's cache does; an exported program keeps its own copy of each buffer.
            self.register_buffer("k_pool", shared_pools[0])
            self.register_buffer("v_pool", shared_pools[1])

    def forward(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, grid_id: torch.Tensor,
                text_emb: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                k_pool: Optional[torch.Tensor] = None, v_pool: Optional[torch.Tensor] = None):
        if self.kv_pool == "buffer":
            call = _StepCall(slots, visible, self.k_pool, self.v_pool, in_place=True)
        else:
            call = _StepCall(slots, visible, k_pool, v_pool, in_place=False)
        inputs = {"noisy_latents": noisy_latents, "timesteps": timesteps, "grid_id": grid_id, "text_emb": text_emb}
        with self._pool_attention(call):
            pred = self.transformer(inputs, update_cache=0, cache_name=_NO_EAGER_CACHE,
                                    action_mode=self.action_mode)
        if self.kv_pool == "buffer":
            return pred
        return pred, torch.stack(call.k_layers), torch.stack(call.v_layers)

    @contextlib.contextmanager
    def _pool_attention(self, call: _StepCall) -> Iterator[None]:
        # Swapped in for the duration of one call only, so the policy's own eager code is untouched outside it.
        attentions = [block.attn1 for block in self.transformer.blocks]
        saved = [attn.attn_op for attn in attentions]
        try:
            for layer, attn in enumerate(attentions):
                attn.attn_op = functools.partial(_pool_attention, call, layer)
            yield
        finally:
            for attn, op in zip(attentions, saved):
                attn.attn_op = op


def _pool_attention(call: _StepCall, layer: int, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor) -> torch.Tensor:
    """Replacement for ``WanAttention.attn_op`` (``custom_sdpa``): ``[B, L, H, D]`` in and out, K already roped."""
    if call.in_place:
        k_layer, v_layer = call.k_pool[layer], call.v_pool[layer]
        k_layer.index_copy_(1, call.slots, key)
        v_layer.index_copy_(1, call.slots, value)
    else:
        k_layer = call.k_pool[layer].index_copy(1, call.slots, key)
        v_layer = call.v_pool[layer].index_copy(1, call.slots, value)
        call.k_layers.append(k_layer)
        call.v_layers.append(v_layer)
    batch, length = query.shape[0], query.shape[1]
    # [B, 1, L, T] bool: the 4-D, batch-leading shape the Triton SDPA kernel of the CUDA backend accepts.
    mask = call.keys_visible[None, None, None, :].expand(batch, 1, length, call.keys_visible.shape[0])
    out = F.scaled_dot_product_attention(query.transpose(1, 2), k_layer.transpose(1, 2), v_layer.transpose(1, 2),
                                         attn_mask=mask)
    return out.transpose(1, 2)


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


def zero_pools(shape: Sequence[int], dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fresh K and V pools. Zeros, not ``empty``: a masked slot still enters the attention kernel's arithmetic,
    and NaN/Inf garbage there poisons every row (seen with bf16 ``torch.empty`` pools)."""
    return torch.zeros(tuple(shape), dtype=dtype), torch.zeros(tuple(shape), dtype=dtype)

