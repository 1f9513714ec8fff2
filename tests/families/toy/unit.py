"""The toy family (tests only), found like a shipped one: tests/support/environment.py puts tests/families on
zoo.policies' search path, so ``family: toy`` recipes load, validate and build through the same convention
(``zoo.policies.toy``), and the pipeline, hub and CLI can be tested end to end without lerobot.

Two kinds: a tiny Meta-style complex-rotary attention ("rope"), or a two-method unit sharing a mutable pool buffer
written with ``index_copy_`` ("pool": LingBot's KV-pool protocol in miniature). Its checkpoint has the real layout
(config.json + model.safetensors + a processor file) and it loads strictly, raising zoo errors for a wrong model
type or missing/mismatched weights as the real families do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core.errors import PullError, RecipeError
from zoo.policies.base import ExportUnit, InputSpec, MethodSpec

TOY_MODEL_TYPE = "zoo_toy"


class ToyRope(nn.Module):
    """Causal self-attention with Meta's complex rotary embedding: a complex64 table sliced to the length."""

    def __init__(self, dim: int, heads: int, max_seq: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        b, length, h, d = x.shape
        xc = torch.view_as_complex(x.float().reshape(b, length, h, d // 2, 2))
        freqs = self.freqs_cis[:length].view(1, length, 1, d // 2)
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, dim = x.shape
        shape = (b, length, self.heads, self.head_dim)
        q = self.rotate(self.wq(x).view(shape)).transpose(1, 2)
        k = self.rotate(self.wk(x).view(shape)).transpose(1, 2)
        v = self.wv(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, length, dim))


class ToyPool(nn.Module):
    """A pool of ``slots`` rows shared by two methods: ``write`` stores projected rows at host-chosen slots
    (in place, like LingBot's KV pool), ``read`` attends over the whole pool."""

    def __init__(self, dim: int, slots: int):
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.register_buffer("pool", torch.zeros(slots, dim), persistent=False)  # zero state, not a weight


class ToyWrite(nn.Module):
    def __init__(self, core: ToyPool):
        super().__init__()
        self.core = core

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self.core.pool.index_copy_(0, slots, self.core.wk(x))
        return self.core.pool.sum(dim=0)


class ToyRead(nn.Module):
    def __init__(self, core: ToyPool):
        super().__init__()
        self.core = core

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        scores = self.core.wq(q) @ self.core.pool.t()
        return torch.softmax(scores, dim=-1) @ self.core.pool


def toy_weight_shapes(config: Dict) -> Dict[str, tuple]:
    dim = config["dim"]
    names = ("wq", "wk", "wv", "wo") if config["kind"] == "rope" else ("wq", "wk")
    prefix = "" if config["kind"] == "rope" else "core."
    return {f"{prefix}{n}.weight": (dim, dim) for n in names}


def fabricate_checkpoint(recipe, work_dir: Path) -> Dict[str, Path]:
    from safetensors.torch import save_file

    opts = recipe.unit.options  # ToyOptions
    config = {"model_type": TOY_MODEL_TYPE, "kind": opts.kind, "dim": opts.dim, "heads": opts.heads,
              "slots": opts.slots}
    g = torch.Generator().manual_seed(int(recipe.source.seed))
    folder = Path(work_dir) / "policy"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: torch.randn(shape, generator=g) / shape[1] ** 0.5
               for name, shape in sorted(toy_weight_shapes(config).items())}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "policy_preprocessor.json").write_text(json.dumps({"name": "toy", "steps": []}))
    # An auxiliary repo the policy would load by id (like Fast-WAM's VAE), to show it lands in the cache.
    aux = Path(work_dir) / "aux"
    aux.mkdir()
    (aux / "config.json").write_text(json.dumps({"what": "toy auxiliary repo"}))
    return {recipe.source.repo_id: folder, "toy-org/toy-aux": aux}


def check_recipe(recipe) -> None:
    methods = ["forward"] if recipe.unit.options.kind == "rope" else ["write", "read"]
    if list(recipe.unit.methods) != methods:
        raise RecipeError(f"recipe {recipe.name!r}: unit.methods={list(recipe.unit.methods)}; a toy "
                          f"{recipe.unit.options.kind} unit has {methods}", f"set unit.methods: {methods}")


def _load_module(checkpoint_dir: Path, recipe):
    """The toy model of the checkpoint, loaded strictly, in the recipe's dtype; and its config."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = json.loads((checkpoint_dir / "config.json").read_text())
    if config.get("model_type") != TOY_MODEL_TYPE:
        raise PullError(f"{checkpoint_dir} is a {config.get('model_type')!r} checkpoint, not {TOY_MODEL_TYPE!r}",
                        "point the recipe at a toy checkpoint")
    try:
        state = load_file(str(checkpoint_dir / "model.safetensors"))
    except (SafetensorError, OSError) as exc:
        raise PullError(f"{checkpoint_dir}/model.safetensors cannot be read: {exc}", "re-download it") from exc
    if config["kind"] == "rope":
        module = ToyRope(config["dim"], config["heads"], max_seq=recipe.dynamic["seq"].max)
    else:
        module = ToyPool(config["dim"], config["slots"])
    try:
        module.load_state_dict({k.replace("core.", "", 1): v for k, v in state.items()}, strict=True)
    except RuntimeError as exc:
        raise PullError(f"{checkpoint_dir}: weights do not match the toy model: {' '.join(str(exc).split())}",
                        "use a checkpoint of this recipe") from exc
    # Module.to(dtype) would also cast the complex table (dropping its imaginary part): cast real tensors only.
    dtype = getattr(torch, recipe.unit.dtype)
    module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    return module.eval(), config


def build_unit(checkpoint_dir: Path, recipe) -> ExportUnit:
    checkpoint_dir = Path(checkpoint_dir)
    if recipe.unit.options.load_aux:
        # Like Fast-WAM's VAE: a repo the policy loads by Hub id, through whatever cache is configured.
        from huggingface_hub import snapshot_download

        json.loads((Path(snapshot_download("toy-org/toy-aux")) / "config.json").read_text())
    module, config = _load_module(checkpoint_dir, recipe)
    float_dtype, dim = recipe.unit.dtype, config["dim"]
    files = [checkpoint_dir / "policy_preprocessor.json"]
    if config["kind"] == "rope":
        methods = {"forward": MethodSpec("forward", module, [InputSpec("x", float_dtype, [1, "seq", dim])], ["y"])}
    else:
        slots = config["slots"]
        methods = {
            "write": MethodSpec("write", ToyWrite(module),
                                [InputSpec("x", float_dtype, [2, dim]),
                                 InputSpec("slots", "int64", [2], f"randperm:{slots}")], ["pool_sum"]),
            "read": MethodSpec("read", ToyRead(module), [InputSpec("q", float_dtype, [3, dim])], ["out"]),
        }
    return ExportUnit(family="toy", methods=methods, host_files=files)  # no host loop: NoHostSettings
