"""LingBot-VA's export unit core: one DiT step (LeRobot's ``WanTransformer3DModel``, called unchanged) over an
explicit, fixed KV pool instead of LeRobot's data-dependent cache, which ``torch.export`` cannot trace."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from zoo.contract.host_settings import pool_buffer_names
from zoo.policies.lingbot_va.prompt_kv import prompt_free


KV_POOL_LAYOUTS = ("io", "buffer")
# A cache name no LeRobot attention holds, so WanAttention.forward skips its own cache path entirely.
_NO_EAGER_CACHE = "zoo_kv_pool"


# The pools of one call: a stacked [layers, ...] tensor ("io" layout) or one [B, T, H, D] buffer per layer
# ("buffer" layout); ``pools[layer]`` is that layer's pool either way.
Pools = Union[torch.Tensor, Sequence[torch.Tensor]]


class _StepCall:
    """What one step's self-attentions share: slots to write, the attention mask, and the pools."""

    def __init__(self, slots: torch.Tensor, visible: torch.Tensor, k_pool: Pools, v_pool: Pools, in_place: bool):
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
    (pred, k_pool_next, v_pool_next)``. Layout ``"buffer"``: the pools are this module's buffers, one K and one V
    per layer (``k_pool_<layer>``, ``v_pool_<layer>``: ``pool_buffer_names``), updated in place, and
    ``forward(noisy_latents, timesteps, grid_id, text_emb, slots, visible) -> pred``.

    Why one buffer per layer, not one stacked ``[layers, ...]`` buffer: Inductor (torch 2.11) compiles an in-place
    write into a view of a buffer (``k_pool[layer].index_copy_``) as a copy of the whole layer, the scatter into
    that copy, and a rewrite of the whole stacked buffer from the copies (``select_scatter``, the ``stack``
    kernels of the "io" layout); written directly into a buffer of its own, the same ``index_copy_`` becomes a
    scatter of the new slots in place. Read off Inductor's generated code, docs/host-loops.md.

    ``slots``: int64 ``[L]``, distinct pool indices receiving this step's K/V. ``visible``: bool ``[T_pool]``,
    the slots holding valid K/V from earlier steps (the new slots are added by the unit itself).
    """

    def __init__(self, transformer: torch.nn.Module, action_mode: bool, kv_pool: str,
                 shared_pools: Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]] = None):
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
            # LeRobot's cache does; an exported program holds its own copy, which the runtimes share by name.
            k_layers, v_layers = shared_pools
            names = pool_buffer_names(len(k_layers))
            for name, tensor in zip(names, [t for pair in zip(k_layers, v_layers) for t in pair]):
                self.register_buffer(name, tensor)

    def pool_layers(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Layout ``"buffer"``: the K and the V buffer of each layer, in layer order."""
        names = pool_buffer_names(len(self.transformer.blocks))
        return [self.get_buffer(n) for n in names[0::2]], [self.get_buffer(n) for n in names[1::2]]

    def forward(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, grid_id: torch.Tensor,
                text_emb: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                k_pool: Optional[torch.Tensor] = None, v_pool: Optional[torch.Tensor] = None):
        inputs = {"noisy_latents": noisy_latents, "timesteps": timesteps, "grid_id": grid_id, "text_emb": text_emb}
        return self._step(inputs, slots, visible, k_pool, v_pool)

    def _step(self, inputs, slots, visible, k_pool, v_pool):
        if self.kv_pool == "buffer":
            call = _StepCall(slots, visible, *self.pool_layers(), in_place=True)
        else:
            call = _StepCall(slots, visible, k_pool, v_pool, in_place=False)
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


class PromptFreePoolStep(PoolStep):
    """``PoolStep`` with the prompt's cross-attention K/V as inputs (``zoo.policies.lingbot_va.prompt_kv``) in
    place of ``text_emb``: ``forward(noisy_latents, timesteps, grid_id, text_k, text_v, slots, visible[, k_pool,
    v_pool])``, the rest as ``PoolStep``. Its transformer is a view of LeRobot's without the prompt's weights."""

    def __init__(self, transformer: torch.nn.Module, action_mode: bool, kv_pool: str,
                 shared_pools: Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]] = None):
        view, prompt = prompt_free(transformer)
        super().__init__(view, action_mode, kv_pool, shared_pools)
        self._prompt = prompt

    def forward(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, grid_id: torch.Tensor,
                text_k: torch.Tensor, text_v: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                k_pool: Optional[torch.Tensor] = None, v_pool: Optional[torch.Tensor] = None):
        # The text projection is an identity in the view and the cross-attentions ignore what it passes on: any
        # tensor will do as LeRobot's text_emb.
        inputs = {"noisy_latents": noisy_latents, "timesteps": timesteps, "grid_id": grid_id, "text_emb": text_k}
        self._prompt.text_k, self._prompt.text_v = text_k, text_v
        try:
            return self._step(inputs, slots, visible, k_pool, v_pool)
        finally:
            self._prompt.text_k = self._prompt.text_v = None


# LeRobot's ``WanAttention`` keeps its KV cache in Python dicts and picks slots with ``nonzero`` and
# data-dependent eviction (``lingbot_va/utils.py:585-632``). Here the cache is a zero-initialised pool
# ``[layers, B, T_pool, heads, head_dim]`` (in the "buffer" layout one buffer per layer): each step writes its
# new K/V with ``index_copy_`` at slots the host chose (``zoo.runner.slots.HostSlotAllocator``) and attends over
# the whole pool under a bool mask. This equals LeRobot's attention over ``[valid slots] ∪ [new tokens]`` because
# softmax is permutation invariant over keys and a masked key contributes exactly zero, as long as masked slots
# hold finite values (hence zeros, never ``torch.empty``; stale K/V of an earlier episode are finite too). RoPE
# is applied to K before it is stored, in both. Only each self-attention's ``attn_op`` is swapped for the pool
# attention, during a call.
def _pool_attention(call: _StepCall, layer: int, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor) -> torch.Tensor:
    """Replacement for ``WanAttention.attn_op`` (``custom_sdpa``): ``[B, L, H, D]`` in and out, K already roped."""
    if call.in_place:  # straight into the layer's own buffer: a scatter of the new slots, nothing copied
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


def zero_pools(shape: Sequence[int], dtype: torch.dtype) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Fresh K and V pools of ``shape`` ``[layers, B, T, H, D]`` as the "buffer" layout holds them: one
    ``[B, T, H, D]`` tensor per layer for K and for V. Zeros, not ``empty``: a masked slot still enters the
    attention kernel's arithmetic, and NaN/Inf garbage there poisons every row (seen with bf16 ``torch.empty``
    pools)."""
    layers, per_layer = int(shape[0]), tuple(shape[1:])
    return ([torch.zeros(per_layer, dtype=dtype) for _ in range(layers)],
            [torch.zeros(per_layer, dtype=dtype) for _ in range(layers)])

