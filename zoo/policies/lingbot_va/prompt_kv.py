"""LingBot-VA's prompt K/V, computed once per prompt instead of in every DiT call.

In every call, LeRobot's DiT projects the prompt embedding (``condition_embedder.text_embedder``) and each block's
cross-attention then computes ``norm_k(to_k(.))`` and ``to_v(.)`` of it (``WanTransformer3DModel.forward``,
``WanAttention.forward``, lingbot_va/utils.py). The prompt is fixed for an episode, so these are the same in every
call. At LingBot-VA's real size they are ~1160 of an ``action_step``'s 1518 GFLOP (30 blocks, two 3072 x 3072
GEMMs over 2 x 512 rows) and 1.1 GB of the weights it reads.

``PromptKv`` is the method that computes them: ``text_emb -> (text_k, text_v)``, each
``[layers, batch, text_len, heads, head_dim]``. ``prompt_free(transformer)`` is a view of LeRobot's transformer,
sharing its parameters, whose cross-attentions read those K/V and which no longer holds the weights that made
them, so an exported step neither computes nor carries them.
"""

from __future__ import annotations

import copy
import functools
from typing import Optional, Tuple

import torch
from torch import nn

# The cross-attention weights that only the prompt's K/V use (WanAttention.__init__).
_PROMPT_ONLY = ("to_k", "to_v", "norm_k")


class PromptKv(nn.Module):
    """``forward(text_emb) -> (text_k, text_v)``: every block's cross-attention K (normed) and V, heads split."""

    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.text_embedder = transformer.condition_embedder.text_embedder
        self.cross = nn.ModuleList(_PromptProjection(block.attn2) for block in transformer.blocks)

    def forward(self, text_emb: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        context = self.text_embedder(text_emb)
        keys = [proj.norm_k(proj.to_k(context)).unflatten(2, (proj.heads, -1)) for proj in self.cross]
        values = [proj.to_v(context).unflatten(2, (proj.heads, -1)) for proj in self.cross]
        return torch.stack(keys), torch.stack(values)


class _PromptProjection(nn.Module):
    """One cross-attention's K and V projections (LeRobot's own modules, shared), without its query and output
    weights, which only the steps use."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.to_k, self.to_v, self.norm_k = attn.to_k, attn.to_v, attn.norm_k
        self.heads = attn.heads


class PromptInputs:
    """The prompt K/V one call's cross-attentions read (set by the step around its transformer call)."""

    def __init__(self):
        self.text_k: Optional[torch.Tensor] = None
        self.text_v: Optional[torch.Tensor] = None


def prompt_free(transformer: nn.Module) -> Tuple[nn.Module, PromptInputs]:
    """A view of ``transformer`` (its parameters shared, not copied) that takes the prompt's K/V as inputs: the
    text projection passes its input through, and each cross-attention reads ``PromptInputs`` and lacks
    ``to_k``/``to_v``/``norm_k``. Only the modules on the way to those are copied; LeRobot's own are untouched."""
    prompt = PromptInputs()
    view = _shallow(transformer)
    embedder = _shallow(transformer.condition_embedder)
    embedder._modules["text_embedder"] = nn.Identity()
    view._modules["condition_embedder"] = embedder
    blocks = nn.ModuleList()
    for layer, block in enumerate(transformer.blocks):
        own = _shallow(block)
        attn = _shallow(block.attn2)
        for name in _PROMPT_ONLY:
            del attn._modules[name]
        # An instance attribute, on this private copy only: nn.Module.__call__ looks it up before the class's.
        object.__setattr__(attn, "forward", functools.partial(_cross_attention, prompt, layer, attn))
        own._modules["attn2"] = attn
        blocks.append(own)
    view._modules["blocks"] = blocks
    return view, prompt


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its own submodule table, sharing parameters, buffers and submodules."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


def _cross_attention(prompt: PromptInputs, layer: int, attn: nn.Module, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, rotary_emb=None, update_cache: int = 0, cache_name: str = "pos") -> torch.Tensor:
    """``WanAttention.forward`` for a cross-attention (no rotary, no cache), with K and V given: LeRobot's query
    path and output projection, op for op."""
    query = attn.norm_q(attn.to_q(q)).unflatten(2, (attn.heads, -1))
    hidden = attn.attn_op(query, prompt.text_k[layer], prompt.text_v[layer])
    hidden = hidden.flatten(2, 3).type_as(query)
    return attn.to_out[1](attn.to_out[0](hidden))
