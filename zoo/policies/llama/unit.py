"""Llama-style family: a decoder in Meta's reference formulation (complex ``freqs_cis`` rotary, RMSNorm, SwiGLU,
grouped-query attention), loaded from an HF-format checkpoint, whose q/k rows are permuted from HF's rotate-half
order (docs/ARCHITECTURE.md, "The Llama unit").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core.errors import PullError, RecipeError
from zoo.contract.host_settings import LlamaHostSettings
from zoo.contract.recipes import Recipe
from zoo.policies.base import ExportUnit, InputSpec, MethodSpec

FAMILY = "llama"
METHOD = "forward"
SEQ_DIM = "seq"

# Files a deploy side needs besides the .pte to turn text into tokens and back; copied when present.
HOST_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json")

# LlamaConfig fields a recipe gives (unit.options.fabricate_config, LlamaOptions) so zoo can fabricate a
# checkpoint of that size; the geometry keys are required because LlamaConfig's defaults describe a 7B model.
_FABRICATE_REQUIRED = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                       "intermediate_size", "vocab_size", "max_position_embeddings")
_FABRICATE_OPTIONAL = ("head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings")


@dataclass(frozen=True)
class LlamaArgs:
    """The decoder's geometry and constants, read from the checkpoint's config.json."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    tied_embeddings: bool
    max_position_embeddings: int


# --------------------------------------------------------------------------------------------------------
# The decoder, Meta's reference formulation


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    """complex64 [end, head_dim/2]: e^{i t f_j} for positions t and frequencies f_j = theta^(-2j/head_dim)."""
    # Built on the CPU explicitly, also when the module is constructed under torch.device("meta").
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device="cpu")[: head_dim // 2].float() / head_dim))
    t = torch.arange(end, dtype=torch.float32, device="cpu")
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate interleaved pairs (x[2j], x[2j+1]) of q and k [b, s, h, d] by freqs_cis [s, d/2], in float32."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, freqs_cis.shape[0], 1, freqs_cis.shape[1])  # broadcast over batch and heads
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, s, kv_heads, d] -> [b, s, kv_heads * n_rep, d], each key/value head serving n_rep query heads."""
    if n_rep == 1:
        return x
    b, s, n_kv, d = x.shape
    return x[:, :, :, None, :].expand(b, s, n_kv, n_rep, d).reshape(b, s, n_kv * n_rep, d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the compute dtype, as both Meta's and HF's code do.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False, dtype=dtype)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        xq = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        xk = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        n_rep = self.n_heads // self.n_kv_heads
        keys, values = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, a: LlamaArgs, dtype: torch.dtype):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False, dtype=dtype)  # gate
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False, dtype=dtype)  # down
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False, dtype=dtype)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: LlamaArgs, dtype: torch.dtype):
        super().__init__()
        self.attention = Attention(a, dtype)
        self.feed_forward = FeedForward(a, dtype)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps, dtype)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps, dtype)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaDecoder(nn.Module):
    """``forward(tokens int64 [1, seq]) -> logits float32 [1, seq, vocab]``: a prefill over the whole sequence.

    ``max_seq`` sizes the rotary table: the unit accepts any length up to it. Weights are created directly in
    ``dtype``; do not ``.to(bfloat16)`` the module afterwards: ``Module.to(dtype)`` also casts complex buffers
    and would drop the imaginary half of ``freqs_cis`` (``.float()``/``.bfloat16()`` leave it alone).
    """

    def __init__(self, a: LlamaArgs, max_seq: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim, dtype=dtype)
        self.layers = nn.ModuleList(TransformerBlock(a, dtype) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps, dtype)
        # Tied checkpoints reuse the embedding matrix: no second parameter, so the artifact stores it once.
        self.output = None if a.tied_embeddings else nn.Linear(a.dim, a.vocab_size, bias=False, dtype=dtype)
        # Derived from config.json, not stored in the checkpoint: a non-persistent buffer.
        self.register_buffer("freqs_cis", precompute_freqs_cis(a.head_dim, max_seq, a.rope_theta), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        h = self.norm(h)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(h, weight).float()


# --------------------------------------------------------------------------------------------------------
# HF checkpoint -> decoder weights


def hf_to_meta_rows(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder a q/k projection's rows from HF's rotate-half layout to Meta's interleaved pairs, per head.

    HF row ``c * head_dim/2 + j`` of a head (c = 0 real, 1 imaginary part of pair j) becomes Meta row ``2j + c``.
    """
    rows, cols = w.shape
    return w.view(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def read_config(checkpoint_dir: Path) -> Dict[str, Any]:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise PullError(f"{checkpoint_dir} has no config.json, so it is not an HF-format checkpoint",
                        "point the recipe at a Llama-architecture checkpoint in HF format (config.json + "
                        "model.safetensors)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PullError(f"{path} cannot be read as JSON: {exc}",
                        "the download is incomplete or corrupt: delete that snapshot and pull again") from None


def parse_config(config: Dict[str, Any], where: str) -> LlamaArgs:
    """Check that config.json describes a plain Llama decoder this family computes exactly; read its numbers."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type != "llama" or (archs and "LlamaForCausalLM" not in archs):
        # LeRobot policy configs name their type under "type"; show whichever the file has.
        found = ", ".join(f"{k}={config[k]!r}" for k in ("model_type", "type", "architectures") if k in config)
        raise PullError(f"{where} is not a Llama checkpoint: config.json has {found or 'no model_type'}",
                        "the llama family loads HF-format checkpoints with model_type 'llama' and "
                        "architectures ['LlamaForCausalLM']; pick a recipe of the checkpoint's own family")

    def refuse(what: str) -> None:
        raise PullError(f"{where}: config.json has {what}, which the llama family does not implement",
                        "use a checkpoint with default RoPE, no biases and SiLU MLP (e.g. SmolLM2), "
                        "or extend zoo/policies/llama.py with a test against transformers")

    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    for table in (rope, scaling):
        kind = table.get("rope_type", table.get("type", "default"))
        if kind != "default":
            refuse(f"rope scaling {kind!r}")
    for table in (rope, config):
        if float(table.get("partial_rotary_factor") or 1.0) != 1.0:
            refuse(f"partial_rotary_factor={table['partial_rotary_factor']} (rotary on part of each head)")
    if config.get("rope_interleaved"):
        refuse("rope_interleaved=true (q/k already in interleaved order)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        refuse("attention_bias/mlp_bias=true")
    if config.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act={config.get('hidden_act')!r}")

    try:
        dim = int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        n_kv = int(config.get("num_key_value_heads") or n_heads)
        head_dim = int(config.get("head_dim") or dim // n_heads)
        args = LlamaArgs(
            dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=n_heads, n_kv_heads=n_kv,
            head_dim=head_dim, ffn_dim=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            # transformers 5 writes rope_parameters.rope_theta; older checkpoints a top-level rope_theta.
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PullError(f"{where}: config.json lacks or mangles a Llama field ({exc!r})",
                        "the config must give hidden_size, num_attention_heads, num_hidden_layers, "
                        "intermediate_size and vocab_size as numbers") from None
    if head_dim % 2 or n_heads % n_kv:
        raise PullError(f"{where}: head_dim={head_dim} must be even and num_attention_heads={n_heads} a multiple "
                        f"of num_key_value_heads={n_kv}", "the checkpoint's config.json is inconsistent")
    return args


def expected_shapes(a: LlamaArgs) -> Dict[str, Tuple[int, ...]]:
    """HF tensor name -> shape, every tensor a strict load needs."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    shapes: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, a.dim),
                                          "model.norm.weight": (a.dim,)}
    for i in range(a.n_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, a.dim), p + "self_attn.k_proj.weight": (kv, a.dim),
            p + "self_attn.v_proj.weight": (kv, a.dim), p + "self_attn.o_proj.weight": (a.dim, q),
            p + "mlp.gate_proj.weight": (a.ffn_dim, a.dim), p + "mlp.up_proj.weight": (a.ffn_dim, a.dim),
            p + "mlp.down_proj.weight": (a.dim, a.ffn_dim),
            p + "input_layernorm.weight": (a.dim,), p + "post_attention_layernorm.weight": (a.dim,),
        })
    if not a.tied_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, a.dim)
    return shapes


def read_tensors(checkpoint_dir: Path) -> Dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors``, or of the shards ``model.safetensors.index.json`` names."""
    from safetensors import safe_open

    root = Path(checkpoint_dir)
    index = root / "model.safetensors.index.json"
    if (root / "model.safetensors").is_file():
        files = [root / "model.safetensors"]
    elif index.is_file():
        try:
            files = [root / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise PullError(f"{index} is not a readable shard index ({exc!r})",
                            "the download is incomplete or corrupt: delete that snapshot and pull again") from None
    else:
        raise PullError(f"{root} has no model.safetensors (nor model.safetensors.index.json)",
                        "the llama family reads safetensors weights; pull a checkpoint that has them")
    tensors: Dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own SafetensorError, OSError, or RuntimeError
            raise PullError(f"{path} cannot be read as safetensors: {str(exc).strip()}",
                            "the download is incomplete or corrupt: delete that snapshot and pull again") from None
    return tensors


def decoder_state(a: LlamaArgs, tensors: Dict[str, torch.Tensor], dtype: torch.dtype,
                  where: str) -> Dict[str, torch.Tensor]:
    """Check the HF tensors strictly (present, shaped, finite, nothing extra) and map them to decoder names."""
    want = expected_shapes(a)
    for name, shape in want.items():
        if name not in tensors:
            raise PullError(f"{where}: tensor {name!r} is missing from the checkpoint",
                            "the checkpoint is incomplete or not this architecture: pull it again")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise PullError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config.json implies {shape}",
                            "config.json and the weights disagree: pull the checkpoint again")
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise PullError(f"{where}: tensor {name!r} is not finite floating point (dtype {t.dtype})",
                            "the weights are corrupt: pull the checkpoint again")
    extra = sorted(n for n in tensors if n not in want)
    if a.tied_embeddings and "lm_head.weight" in extra:
        # Some tied checkpoints store the head anyway; it is only harmless if it is the embedding itself.
        if torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            extra.remove("lm_head.weight")
    # Older transformers saved the derived rotary inverse frequencies; HF ignores them on load, and so do we.
    extra = [n for n in extra if not n.endswith("rotary_emb.inv_freq")]
    if extra:
        raise PullError(f"{where}: unexpected tensor(s) in the checkpoint: {', '.join(extra[:5])}"
                        + (f" and {len(extra) - 5} more" if len(extra) > 5 else ""),
                        "the weights do not belong to the architecture config.json describes: check that "
                        "config.json and the safetensors come from the same checkpoint")

    def w(name: str) -> torch.Tensor:
        return tensors[name].to(dtype)

    state = {"tok_embeddings.weight": w("model.embed_tokens.weight"), "norm.weight": w("model.norm.weight")}
    if not a.tied_embeddings:
        state["output.weight"] = w("lm_head.weight")
    for i in range(a.n_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        state.update({
            m + "attention.wq.weight": hf_to_meta_rows(w(p + "self_attn.q_proj.weight"), a.n_heads, a.head_dim),
            m + "attention.wk.weight": hf_to_meta_rows(w(p + "self_attn.k_proj.weight"), a.n_kv_heads, a.head_dim),
            m + "attention.wv.weight": w(p + "self_attn.v_proj.weight"),
            m + "attention.wo.weight": w(p + "self_attn.o_proj.weight"),
            m + "feed_forward.w1.weight": w(p + "mlp.gate_proj.weight"),
            m + "feed_forward.w3.weight": w(p + "mlp.up_proj.weight"),
            m + "feed_forward.w2.weight": w(p + "mlp.down_proj.weight"),
            m + "attention_norm.weight": w(p + "input_layernorm.weight"),
            m + "ffn_norm.weight": w(p + "post_attention_layernorm.weight"),
        })
    return state


# --------------------------------------------------------------------------------------------------------
# Recipe checks, the unit, fabrication


def check_recipe(recipe: Recipe) -> int:
    """Validate the llama-specific parts of a recipe (its unit.options the schema checked, LlamaOptions); return
    the largest sequence length the unit accepts."""
    name = recipe.name
    if recipe.family != FAMILY:
        raise RecipeError(f"recipe {name!r} has family {recipe.family!r}, not {FAMILY!r}",
                          "build it with its own family module")
    if list(recipe.unit.methods) != [METHOD]:
        raise RecipeError(f"recipe {name!r}: unit.methods={list(recipe.unit.methods)}; the llama unit has one "
                          f"method", f"set unit.methods: [{METHOD}]")
    if recipe.inputs:
        raise RecipeError(f"recipe {name!r}: inputs {sorted(recipe.inputs)} mean nothing to the llama family",
                          f"the only size is the dynamic dim {SEQ_DIM!r}: remove `inputs`")
    if set(recipe.dynamic) != {SEQ_DIM}:
        raise RecipeError(f"recipe {name!r}: dynamic dims {sorted(recipe.dynamic)}; the llama unit has exactly "
                          f"one, {SEQ_DIM!r}", f"set dynamic: {{{SEQ_DIM}: {{min: 2, max: N}}}}")
    seq = recipe.dynamic[SEQ_DIM]
    if seq.min < 2:
        raise RecipeError(f"recipe {name!r}: dynamic.{SEQ_DIM}.min={seq.min}",
                          "torch.export specialises sizes 0 and 1; set min to 2 or more")
    return int(seq.max)


def build_unit(checkpoint_dir: Path, recipe: Recipe) -> ExportUnit:
    """Load an HF Llama checkpoint strictly into Meta's formulation; one method ``forward(tokens) -> logits``."""
    max_seq = check_recipe(recipe)
    checkpoint_dir = Path(checkpoint_dir)
    where = f"checkpoint {checkpoint_dir}"
    config = read_config(checkpoint_dir)
    args = parse_config(config, where)
    if max_seq > args.max_position_embeddings:
        raise RecipeError(f"recipe {recipe.name!r}: dynamic.{SEQ_DIM}.max={max_seq} exceeds the checkpoint's "
                          f"max_position_embeddings={args.max_position_embeddings}",
                          f"set dynamic.{SEQ_DIM}.max <= {args.max_position_embeddings}")
    dtype = getattr(torch, recipe.unit.dtype)
    state = decoder_state(args, read_tensors(checkpoint_dir), dtype, where)
    # Parameters on the meta device take the checkpoint's tensors as they are (assign), instead of first
    # allocating and randomly initialising a second copy of the weights.
    with torch.device("meta"):
        module = LlamaDecoder(args, max_seq, dtype)
    # strict: every parameter comes from the checkpoint (freqs_cis is non-persistent, so not expected here).
    module.load_state_dict(state, strict=True, assign=True)
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)

    method = MethodSpec(
        name=METHOD, module=module,
        inputs=[InputSpec("tokens", "int64", [1, SEQ_DIM], f"randint:0:{args.vocab_size}")],
        output_names=["logits"],
    )
    host_settings = LlamaHostSettings(vocab_size=args.vocab_size, max_seq_len=max_seq, logits_dtype="float32",
                                      bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
                                      rope_theta=args.rope_theta)
    host_files = [checkpoint_dir / n for n in HOST_FILE_NAMES if (checkpoint_dir / n).is_file()]
    return ExportUnit(family=FAMILY, methods={METHOD: method}, host_settings=host_settings,
                      host_files=host_files, reference=transformers_reference(checkpoint_dir, dtype))


def transformers_reference(checkpoint_dir: Path, dtype: torch.dtype) -> Callable[..., Tuple[torch.Tensor, ...]]:
    """``reference(method, tokens) -> (logits,)`` from transformers' own ``LlamaForCausalLM`` (eager attention)
    on the same checkpoint; transformers is imported, and the model loaded, on the first call only."""
    cache: Dict[str, Any] = {}

    def reference(method: str, tokens: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if method != METHOD:
            raise KeyError(f"the llama unit has no method {method!r}")
        if "model" not in cache:
            from transformers import LlamaForCausalLM

            cache["model"] = LlamaForCausalLM.from_pretrained(
                str(checkpoint_dir), dtype=dtype, attn_implementation="eager").eval()
        with torch.no_grad():
            return (cache["model"](input_ids=tokens, use_cache=False).logits.float(),)

    return reference


def _fabricate_config(recipe: Recipe) -> Dict[str, Any]:
    cfg = recipe.unit.options.fabricate_config
    if not isinstance(cfg, dict):
        raise RecipeError(f"recipe {recipe.name!r} has no unit.options.fabricate_config, so zoo does not know "
                          "what size of checkpoint to fabricate",
                          f"give the LlamaConfig fields {', '.join(_FABRICATE_REQUIRED)} there")
    missing = [k for k in _FABRICATE_REQUIRED if k not in cfg]
    unknown = sorted(set(cfg) - set(_FABRICATE_REQUIRED) - set(_FABRICATE_OPTIONAL))
    if missing or unknown:
        raise RecipeError(f"recipe {recipe.name!r}: unit.options.fabricate_config "
                          + (f"lacks {missing}" if missing else f"has unknown keys {unknown}"),
                          f"required: {', '.join(_FABRICATE_REQUIRED)}; optional: {', '.join(_FABRICATE_OPTIONAL)}")
    return dict(cfg)


def fabricate_checkpoint(recipe: Recipe, work_dir: Path) -> Dict[str, Path]:
    """Seeded random weights at the recipe's size, saved by transformers' own ``save_pretrained`` (the real
    HF layout: config.json + model.safetensors). Returns {recipe.source.repo_id: folder}; no auxiliary repos."""
    from transformers import LlamaConfig, LlamaForCausalLM

    check_recipe(recipe)
    config = LlamaConfig(**_fabricate_config(recipe), architectures=["LlamaForCausalLM"])
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(int(recipe.source.seed))
    with torch.no_grad():
        # HF's init (std 0.02, norms at 1) leaves attention nearly uniform and norms inert, which would hide a
        # wrong q/k permutation or norm mapping; draw every weight so each part moves the logits.
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(p.shape[1])
                p.copy_(std * torch.randn(p.shape, generator=g))
    folder = Path(work_dir) / recipe.source.repo_id.replace("/", "--")
    model.save_pretrained(str(folder))
    return {recipe.source.repo_id: folder}
