"""The README.md model card of a published artifact, rendered from its manifest, I/O spec and host settings.

Every number on the card comes from manifest.json, whose tables were copied from the run report that the
verification and audit steps wrote: the card never states a figure nothing measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from zoo.contract.host_settings import HostSettings, host_settings_record
from zoo.contract.io_spec import IoSpec, MethodIo
from zoo.contract.run_folder import SOURCE_JSON
from zoo.core.report import markdown_table
from zoo.export.publish.card_results import (audit_rows, audit_section, chunk_latency_section, gpu_words,
                                             policy_check_section, verification_section)
from zoo.runner import runner_families

BASE_TAGS = ("robotics", "lerobot", "executorch", "cuda", "aoti", "zoo")
RUNNER = "executor_runner --model_path model.pte --data_path aoti_cuda_blob.ptd"


# What each family's export unit is, and what the deploy side keeps (DESIGN.md, "Policy facts").
FAMILY_NOTES: Dict[str, Dict[str, str]] = {
    "lingbot_va": {
        "title": "LingBot-VA",
        "computes": "one transformer step of each stream (`video_step`, `action_step`) of the LingBot-VA "
                    "Wan2.2-style DiT, attending over a fixed, zero-initialised KV pool that each call writes at "
                    "slots the host chooses, plus a validity mask, and the streaming Wan2.2 VAE encode of the "
                    "observed frames (`vae_encode_first`, `vae_encode`) with its causal feature cache passed in and "
                    "out",
        "host": "the per-chunk loop of video and action denoising steps, the sampler, classifier-free guidance, "
                "KV-slot bookkeeping and the normalisation processors (all in `zoo.runner`, no PyTorch model "
                "code), and the UMT5 text encoder, run once per prompt on a workstation (`python -m zoo prompt`)",
        "outputs": "Each call returns one step's transformer prediction; the host's sampler turns the steps into "
                   "an action chunk, which the unnormaliser in `processors/` maps back to robot units.",
    },
    "fast_wam": {
        "title": "Fast-WAM",
        "computes": "the Fast-WAM action chunk's GPU work: the Wan2.2 VAE encode of the first frame "
                    "(`vae_encode`), the video expert's prefill on its latent, and the action expert's denoising "
                    "steps against the cached keys and values (one `action_step` per Euler step, or the unrolled "
                    "`action_chunk`); the noise is an input",
        "host": "the Euler loop, noise generation and the normalisation processors (all in `zoo.runner`, no "
                "PyTorch model code), and the UMT5 text encoder, run once per prompt on a workstation "
                "(`python -m zoo prompt`)",
        "outputs": "The output is the normalised action chunk; the unnormaliser in `processors/` maps it back "
                   "to robot units.",
    },
    "llama": {
        "title": "Llama-style transformer",
        "computes": "a Llama-architecture transformer whose rotary embeddings were rewritten from complex "
                    "numbers to real pairs",
        "host": "tokenisation, sampling and any cache management",
        "outputs": "The outputs are what the source model's forward pass returns for the given positions.",
    },
}


# --- license and base model -----------------------------------------------------------------------------

_LICENSE_KEYS = ("license", "license_name", "license_link")


def source_card_metadata(local_dir: Optional[str]) -> Dict[str, Any]:
    """The YAML header of the source checkpoint's README.md, when the checkpoint is on this machine."""
    if not local_dir:
        return {}
    readme = Path(local_dir) / "README.md"
    if not readme.is_file():
        return {}
    from huggingface_hub.repocard import metadata_load

    try:
        return metadata_load(readme) or {}
    except ValueError:  # a header that is not a mapping: treat as absent, the recipe may still name a license
        return {}


def resolve_license(source: Mapping[str, Any], recipe: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The artifact's license: the source checkpoint's (source.json, else its local model card), else the
    recipe's ``publish.license``. None when nobody states one; the card then says so.
    """
    checkpoint = source.get("local_dir") or source.get("path")  # a local folder, or the pulled snapshot
    for origin, meta in ((SOURCE_JSON, source),
                         ("the source checkpoint's model card", source_card_metadata(checkpoint))):
        if meta.get("license"):
            found = {k: meta[k] for k in _LICENSE_KEYS if meta.get(k)}
            found["from"] = origin
            return found
    chosen = ((recipe.get("publish") or {}).get("license"))
    if chosen:
        return {"license": chosen, "from": "recipe publish.license"}
    return None


def is_fabricated(manifest: Mapping[str, Any]) -> bool:
    return bool(((manifest.get("recipe") or {}).get("source") or {}).get("fabricate")
                or (manifest.get("source") or {}).get("fabricated"))


def card_metadata(manifest: Mapping[str, Any]) -> Dict[str, Any]:
    """The Hub metadata header. base_model is the source repo when it was pulled from the Hub (it has a
    commit): a local folder's repo id is only a label, and fabricated test checkpoints exist only in zoo's
    local cache; either would be a dangling link on the Hub."""
    recipe = manifest.get("recipe") or {}
    family = recipe.get("family")
    meta: Dict[str, Any] = {}
    lic = manifest.get("license") or {}
    for key in _LICENSE_KEYS:
        if lic.get(key):
            meta[key] = lic[key]
    source = manifest.get("source") or {}
    if source.get("repo_id") and source.get("commit") and not is_fabricated(manifest):
        meta["base_model"] = source["repo_id"]
    meta["library_name"] = "executorch"
    meta["pipeline_tag"] = "robotics"
    meta["tags"] = list(BASE_TAGS) + ([family.replace("_", "-")] if family else [])
    return meta


# --- rendering ------------------------------------------------------------------------------------------

def human_size(n: float) -> str:
    """Decimal units, as the Hub shows file sizes."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} GB"


def _shape(shape: List[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _gpu_section(manifest: Mapping[str, Any]) -> List[str]:
    """Which GPUs and hosts run the artifact, as the audit read it from each method's .so (manifest ``gpu``)."""
    gpu = manifest.get("gpu") or {}
    kernels = gpu.get("kernels")
    out = ["## Which GPUs and hosts can run it", ""]
    if not isinstance(kernels, Mapping):
        return out + [f"Kernels compiled for {gpu_words(gpu.get('built_for') or {})}; which other GPUs run them was "
                      "not recorded.", ""]
    images = ", ".join(f"`{i}`" for i in kernels.get("kernel_images") or []) or "none"
    hosts = ", ".join(kernels.get("hosts") or []) or "?"
    out += [f"Read from the compiled code itself: the kernels are {images} (SASS `sm_*` runs as is, PTX `compute_*` "
            f"is compiled by the driver), built for {gpu_words(gpu.get('built_for') or {})}; the host code is "
            f"{hosts}.", ""]
    rows = [["GPUs (zoo's names)", "runs"]]
    if kernels.get("runs_on"):
        rows.append([", ".join(kernels["runs_on"]), "yes"])
    if kernels.get("runs_on_through_ptx_jit"):
        isa = kernels.get("ptx_isa")
        rows.append([", ".join(kernels["runs_on_through_ptx_jit"]), "yes, through the driver's JIT compile of the "
                     "PTX" + (f" (PTX ISA {isa}: a recent enough driver)" if isa else "")])
    rows += [[", ".join(names), f"no: {why}"] for why, names in (kernels.get("not_on") or {}).items()]
    out += [markdown_table(rows), "",
            "zoo's loaders (the policy runner, verification, `zoo_runner`) read this before loading and refuse a "
            "GPU or host it does not fit, saying what to do: lower the run for that GPU (`python -m zoo lower "
            "RUN_DIR --target NAME`, or on the machine itself; a Jetson always lowers on the device).", ""]
    return out


def _runner_section(manifest: Mapping[str, Any], repo_id: str) -> List[str]:
    """The three lines of Python that replace a LeRobot policy in a control loop."""
    family = (manifest.get("recipe") or {}).get("family", "")
    if family not in runner_families():
        return []
    return ["## How to run it from Python", "",
            "`zoo.runner` has LeRobot's policy interface over the artifact (no lerobot, transformers or diffusers "
            "needed): `batch` is the observation dict a LeRobot environment gives, with the same keys, and the "
            "action comes back in robot units (the processors in `processors/` are applied).", "",
            "```python",
            "import zoo.runner",
            f'runner = zoo.runner.load("{repo_id}", backend="artifact")  # eager: the rewritten programs, CPU or GPU',
            "runner.reset()",
            "action = runner.select_action(batch)",
            "```", "",
            "`backend=\"artifact\"` runs each method's `.so` through torch's AOTI runner; `backend=\"executorch\"` "
            "drives `model.pte` + `aoti_cuda_blob.ptd` through ExecuTorch's own C++ runtime (zoo's `zoo_runner`, "
            "`$ZOO_ET_RUNNER`), the state one call hands to the next held on the GPU by the runtime.", "",
            "The task's text embedding is computed once per prompt, on a workstation with lerobot: "
            f'`python -m zoo prompt RUN_DIR "pick up the bowl" -o task.safetensors`, then '
            '`runner.load_prompt("task.safetensors")`. From a shell: `python -m zoo act RUN_DIR --observation '
            "obs.safetensors --prompt task.safetensors --backend artifact` prints one action chunk.", ""]


def io_methods(io_spec: Optional[IoSpec]) -> Dict[str, MethodIo]:
    """Per-method inputs and outputs of io_spec.json; none when the card is rendered without one."""
    return dict(io_spec.methods) if io_spec is not None else {}


def _computes_section(manifest: Mapping[str, Any], io_spec: Optional[IoSpec], note: Mapping[str, str]) -> List[str]:
    recipe = manifest.get("recipe") or {}
    out = ["## What the artifact computes", ""]
    if recipe.get("description"):
        out += [recipe["description"], ""]
    if note:
        dtype = io_spec.dtype if io_spec is not None else (recipe.get("unit") or {}).get("dtype", "float32")
        out += [f"The artifact is {note['computes']}, compiled for the GPU with ExecuTorch's CUDA backend "
                f"(AOTInductor). Compute dtype: `{dtype}`.", ""]
    table = [["method", "inputs (name: dtype shape)", "outputs"]]
    for method, spec in io_methods(io_spec).items():
        inputs = "<br>".join(f"`{i.name}`: {i.dtype} {_shape(i.shape)}" for i in spec.inputs)
        table.append([f"`{method}`", inputs, ", ".join(f"`{o}`" for o in spec.outputs)])
    out += [markdown_table(table), ""]
    dynamic = ({k: (v.min, v.max) for k, v in io_spec.dynamic.items()} if io_spec is not None else
               {k: (v["min"], v["max"]) for k, v in (recipe.get("dynamic") or {}).items()})
    if dynamic:
        out += ["Dynamic dimensions (any size in the range is accepted): "
                + ", ".join(f"`{k}` in [{lo}, {hi}]" for k, (lo, hi) in dynamic.items()) + ".", ""]
    if note:
        out += [note["outputs"], ""]
    return out


def _host_section(host_settings: HostSettings, processors: List[str], note: Mapping[str, str]) -> List[str]:
    out = ["## What stays on the host", ""]
    if note:
        out.append(f"Not in the artifact: {note['host']}.")
    out += ["The deploy side drives the artifact with these settings (`host_settings.json`):", ""]
    record = host_settings_record(host_settings)
    if record:
        out += [markdown_table([["setting", "value"]]
                               + [[f"`{k}`", f"`{json.dumps(v)}`"] for k, v in record.items()]), ""]
    else:
        out += ["none (`host_settings.json` names no host loop): the artifact needs nothing from the host besides "
                "its inputs.", ""]
    if processors:
        out += ["The policy's normalisation processors, copied unchanged from the source checkpoint: "
                + ", ".join(f"`{p}`" for p in processors) + ".", ""]
    return out


def runtime_ref(manifest: Mapping[str, Any]) -> Dict[str, Any]:
    """The ExecuTorch git ref to build the runner from: the release the artifact was exported with when the
    audit says it loads it, else the first audited release that does; ``loadable`` False when none does and
    None when no audit was recorded."""
    exported = str((manifest.get("versions") or {}).get("executorch") or "1.2.0").split("+")[0]
    rows = audit_rows(manifest.get("audit"))
    loadable = [r for r in rows if r["loadable"]]

    def same_release(release: str) -> bool:
        return exported.split(".")[:len(release.split("."))] == release.split(".")

    if not rows or not loadable or any(same_release(r["release"]) for r in loadable):
        return {"ref": f"v{exported}", "release": exported, "loadable": bool(loadable) if rows else None}
    first = loadable[0]
    version = first.get("version") or first["release"]
    # Without an exact version, a release line ("1.4") is built from its release branch.
    ref = f"v{version}" if version.count(".") >= 2 else f"release/{version}"
    return {"ref": ref, "release": version, "loadable": True}


def _run_section(manifest: Mapping[str, Any], repo_id: str, io_spec: Optional[IoSpec]) -> List[str]:
    runtime = runtime_ref(manifest)
    exported = str((manifest.get("versions") or {}).get("executorch") or "?").split("+")[0]
    methods = list(io_methods(io_spec))
    out = ["## How to run it with ExecuTorch", "",
           f"Exported with ExecuTorch {exported}. ExecuTorch's CUDA runtime is built from source with the CUDA "
           "backend (a CUDA toolkit, and a Python with torch at configure time, are needed); "
           + {True: f"this builds ExecuTorch {runtime['release']}, which the audit above says loads the artifact:",
              False: "no audited release loads this artifact (see the audit above), so the runner below fails to "
                     "load it until a runtime provides the missing symbols:",
              None: f"this builds ExecuTorch {runtime['release']}, the release it was exported with:",
              }[runtime["loadable"]], "",
           *_build_lines(manifest, runtime, repo_id)]
    if len(methods) > 1 and not _device_io(manifest):
        out += ["", f"This program has {len(methods)} methods ({', '.join(f'`{m}`' for m in methods)}). The runner "
                    "runs the first unless told otherwise: runner builds that have the `--method_name` flag take "
                    "`--method_name METHOD`; in your own C++ host, load each method by name through "
                    "`executorch::extension::Module`."]
    return out + [""]


def _device_io(manifest: Mapping[str, Any]) -> bool:
    runtime = manifest.get("runtime")
    return isinstance(runtime, Mapping) and bool(runtime.get("device_io"))


def _build_lines(manifest: Mapping[str, Any], runtime: Mapping[str, Any], repo_id: str) -> List[str]:
    """How to build a runner for the artifact and run it. ExecuTorch's ``executor_runner`` hands a method no memory
    for an output it did not plan, so an artifact whose graph I/O is left out of memory planning (``runtime.json``,
    state kept on the GPU) is run with zoo's ``zoo_runner``."""
    requirement = manifest.get("runtime") if isinstance(manifest.get("runtime"), Mapping) else {}
    clone = f"git clone --branch {runtime['ref']} --recursive https://github.com/pytorch/executorch.git ../executorch"
    features = list(requirement.get("features") or [])
    if not _device_io(manifest) and not features:
        return ["```bash", f"hf download {repo_id} --local-dir artifact && cd artifact", clone,
                "cmake -S ../executorch -B ../executorch/cmake-out -DCMAKE_BUILD_TYPE=Release \\",
                "  -DEXECUTORCH_BUILD_CUDA=ON -DEXECUTORCH_BUILD_EXECUTOR_RUNNER=ON \\",
                "  -DEXECUTORCH_BUILD_EXTENSION_DATA_LOADER=ON -DEXECUTORCH_BUILD_EXTENSION_FLAT_TENSOR=ON",
                "cmake --build ../executorch/cmake-out --target executor_runner -j",
                f"../executorch/cmake-out/{RUNNER}", "```", "",
                "`--data_path` hands the runtime the weights blob; the compiled kernels are inside `model.pte`. "
                "Without `--inputs` the runner feeds all-ones tensors; pass raw little-endian tensor files, one per "
                "input in the order of the table above, as `--inputs a.bin,b.bin`."]
    release = requirement["release"]
    device_io = ("Its graph inputs and outputs are left out of memory planning, so that a host can pass GPU "
                 f"pointers as inputs and keep outputs on the GPU (ExecuTorch {release}'s backend options "
                 "`skip_copy_output_to_cpu_for_method` and `use_shared_cuda_stream`): the state one call hands to the "
                 "next never crosses to the host. ExecuTorch's `executor_runner` gives an output no memory it did "
                 "not plan, so it cannot run this artifact; ") if _device_io(manifest) else ""
    additions = (f" It also needs what zoo's build adds to that runtime: {', '.join(features)} (`runtime.json`). Its "
                 "GEMMs call cuBLAS through `aoti_torch_cuda_mm_out` and its kin, which ExecuTorch's own runtime "
                 "lacks: a stock build refuses the `.so` at load, and `scripts/build_runtime.sh` adds them."
                 if features else "")
    return ["```bash", f"hf download {repo_id} --local-dir artifact && cd artifact", clone,
            "# in a checkout of zoo: ExecuTorch's runtime, its CUDA backend and zoo_runner (docs/runtime.md)",
            "scripts/build_runtime.sh ../executorch build/runtime",
            "build/runtime/build/zoo_runner --model model.pte --data aoti_cuda_blob.ptd --plan -",
            "```", "",
            f"It needs ExecuTorch's runtime **{release}** (`runtime.json`; lowered with executorch "
            f"{requirement.get('lowered_with', '?')}). {device_io}`zoo_runner` runs each method by name on tensor "
            "files or on values it holds on the GPU (`$NAME`, `keep:NAME`; `zoo_runner --help`), and "
            "`zoo.runner.load(..., backend=\"executorch\")` drives it from Python." + additions]


def _provenance_section(manifest: Mapping[str, Any]) -> List[str]:
    recipe = manifest.get("recipe") or {}
    source = manifest.get("source") or {}
    versions = manifest.get("versions") or {}
    built = (manifest.get("gpu") or {}).get("built_for") or {}
    lowered = (manifest.get("gpu") or {}).get("lowered_on") or {}
    overrides = manifest.get("overrides") or []
    out = ["## How it was made", "",
           f"- Recipe `{recipe.get('name', '?')}`" + (f" with overrides {', '.join(f'`{o}`' for o in overrides)}"
                                                       if overrides else " without overrides") + ".",
           f"- Source checkpoint `{source.get('repo_id')}`, revision `{source.get('revision')}`, commit "
           f"`{source.get('commit')}`.",
           f"- Kernels compiled for {gpu_words(built)}"
           + (f", lowered on {gpu_words(lowered)}" if lowered and lowered != built else "")
           + ". Other GPUs: see which run it above; the rest need a fresh lowering.",
           "- Versions: " + ", ".join(f"{k} {v if v else 'not installed'}" for k, v in versions.items()) + ".",
           ""]
    rewrites = manifest.get("rewrites") or {}
    table = [["method", "rewrite", "changed", "rewritten nodes"]]
    for method, results in rewrites.items():
        for r in results:
            counts = ", ".join(f"{op} x{n}" for op, n in (r.get("counts") or {}).items()) or "none"
            state = f"declined: {r['declined']}" if r.get("declined") else ("yes" if r.get("changed") else "no")
            table.append([f"`{method}`", r.get("rewrite", "?"), state, counts])
    if len(table) > 1:
        out += ["Graph rewrites applied before lowering:", "", markdown_table(table), ""]
    return out


def _files_section(manifest: Mapping[str, Any]) -> List[str]:
    files = manifest.get("files") or {}
    table = [["file", "size", "sha256"]] + [[f"`{rel}`", human_size(int(f["size"])), f"`{f['sha256']}`"]
                                            for rel, f in sorted(files.items())]
    return ["## Files", "", "`manifest.json` holds all of the above in machine-readable form.", "",
            markdown_table(table), ""]


UNVERIFIED_BANNER = ("> **Unverified preview.** This card was rendered by `python -m zoo publish --dry-run` from a run "
                     "that was not verified on a GPU; zoo refuses to publish it. Lower and verify it first "
                     "(`python -m zoo lower RUN_DIR` on a CUDA machine).")


def render_card(manifest: Mapping[str, Any], io_spec: Optional[IoSpec], host_settings: HostSettings,
                repo_id: str) -> str:
    """The whole README.md: Hub metadata header, then what it is, where it runs, how well, how to run it.
    ``io_spec`` None: the methods are not listed (the manifest's recipe gives the dtype and dynamic dims)."""
    from huggingface_hub import ModelCardData

    recipe = manifest.get("recipe") or {}
    source = manifest.get("source") or {}
    note = FAMILY_NOTES.get(recipe.get("family", ""), {})
    processors = sorted(rel for rel in (manifest.get("files") or {}) if rel.startswith("processors/"))
    header = ModelCardData(**card_metadata(manifest)).to_yaml()
    title = note.get("title", recipe.get("family", "policy"))
    verified = bool((manifest.get("verification") or {}).get("passed"))
    out = ["---", header, "---", "", f"# {repo_id}", "",
           f"{title} exported to an ExecuTorch CUDA artifact (`model.pte` + `aoti_cuda_blob.ptd`) by zoo from "
           f"[`{source.get('repo_id')}`](https://huggingface.co/{source.get('repo_id')}) at commit "
           f"`{source.get('commit')}`" + (", and verified against eager PyTorch on a GPU before publishing."
                                            if verified else "."), ""]
    if not verified:
        out += [UNVERIFIED_BANNER, ""]
    if is_fabricated(manifest):
        out += ["> **Test artifact.** The weights are seeded random numbers in the source's file layout, made by "
                "zoo to exercise the pipeline; the outputs mean nothing.", ""]
    lic = manifest.get("license")
    out += [f"License: `{lic['license']}` (from {lic['from']})." if lic else
            "License: none stated by the source checkpoint or the recipe; ask the source's authors before reuse.", ""]
    out += _computes_section(manifest, io_spec, note)
    out += _host_section(host_settings, processors, note)
    out += audit_section(manifest)
    out += _gpu_section(manifest)
    out += verification_section(manifest)
    out += policy_check_section(manifest, note)
    out += chunk_latency_section(manifest)
    out += _runner_section(manifest, repo_id)
    out += _run_section(manifest, repo_id, io_spec)
    out += _provenance_section(manifest)
    out += _files_section(manifest)
    return "\n".join(out).rstrip() + "\n"
