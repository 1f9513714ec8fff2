"""The model card's sections on what was measured: the runtime audit, verification, the policy check and the
latency of a whole action chunk, each read from the manifest (which copied them from the run report)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from zoo.contract.chunk_latency import measured_for
from zoo.core.report import markdown_table
from zoo.export.audit import how_blobs_are_stored
from zoo.runner import runner_families


def _num(x: Any, fmt: str) -> str:
    return "n/a" if x is None else format(float(x), fmt)


def row_output(row: Mapping[str, Any]) -> str:
    """The output a verification row compares (``output``, or ``name`` as ``numerics.Comparison`` calls it)."""
    return str(row.get("output", row.get("name", "?")))


def _sizes(sizes: Any) -> str:
    if isinstance(sizes, Mapping):
        return ", ".join(f"{k}={v}" for k, v in sizes.items()) or "static"
    return "static" if sizes in (None, "", [], {}) else str(sizes)


def audit_rows(audit: Any) -> List[Dict[str, Any]]:
    """Release rows of the runtime audit, ``{release, version, loadable, missing}``, sorted by release.

    Read from zoo.export.audit's record: ``releases`` maps a release to ``{"version", "loadable", "missing":
    {method: [symbols]}}`` (``AuditResult.as_dict``), or only to its version, the per-method ``missing``
    lists then being under ``methods`` (the dataclass fields of ``AuditResult``).
    """
    if not isinstance(audit, Mapping):
        return []
    releases = audit.get("releases", audit)
    methods = [m for m in audit.get("methods") or [] if isinstance(m, Mapping)]
    rows = []
    for release, entry in releases.items():
        if isinstance(entry, Mapping) and "loadable" in entry:
            version, loadable = entry.get("version"), bool(entry["loadable"])
            missing = entry.get("missing_symbols", entry.get("missing", []))
            if isinstance(missing, Mapping):
                missing = sorted({s for per_method in missing.values() for s in per_method})
        elif isinstance(entry, str) and methods:
            missing = sorted({s for m in methods for s in (m.get("missing") or {}).get(release, [])})
            version, loadable = entry, not missing
        else:
            continue  # facts beside the per-release table
        row = {"release": str(release), "version": version, "loadable": loadable, "missing": list(missing or [])}
        if isinstance(entry, Mapping) and str(entry.get("tested", "")).startswith("by running"):
            row["tested"] = entry["tested"]  # a runtime built from this release ran the artifact
        rows.append(row)

    def key(row: Dict[str, Any]) -> List[int]:
        return [int(p) if p.isdigit() else 0 for p in row["release"].split(".")]

    return sorted(rows, key=key)


def audit_section(manifest: Mapping[str, Any]) -> List[str]:
    rows = audit_rows(manifest.get("audit"))
    out = ["## Which ExecuTorch runtimes can load it", ""]
    if not rows:
        return out + ["No runtime audit was recorded for this artifact.", ""]
    out += ["zoo read every `aoti_torch_*` symbol the compiled kernels need and compared them with what each "
            "ExecuTorch CUDA runtime release exports. A missing symbol means the runtime fails to load the "
            "artifact.", ""]
    out.append(markdown_table([["ExecuTorch release", "loads this artifact", "missing runtime symbols"]]
                              + [[r["release"] + (f" ({r['version']})" if r.get("version") else ""),
                                  "yes" if r["loadable"] else "no",
                                  ", ".join(f"`{s}`" for s in r["missing"]) or "none"] for r in rows]))
    loadable = [r["release"] for r in rows if r["loadable"]]
    out += ["", (f"Loadable by: ExecuTorch {', '.join(loadable)}." if loadable else
                 "No audited ExecuTorch release can load this artifact: it needs the runtime symbols listed above."),
            ""]
    tested = [r for r in rows if r.get("tested")]
    if tested:
        out += [" ".join(f"ExecuTorch {r['release']} was also tested {r['tested']} (its own C++ runtime with the CUDA "
                         "backend, built from source, running this `.pte` + `.ptd`)." for r in tested)
                + " The other releases are inferred from the symbols.", ""]
    return out + _weights_section(manifest.get("audit"), manifest.get("verification"))


def _weights_section(audit: Any, verification: Any = None) -> List[str]:
    """What the audit found about the weights: the .ptd against one copy, and per release what loading every
    method costs on the GPU (zoo.export.audit's ``weights`` and per-release ``caveats``; read in each runtime's source,
    as the audit says)."""
    if not isinstance(audit, Mapping):
        return []
    weights = audit.get("weights") if isinstance(audit.get("weights"), Mapping) else None
    releases = audit.get("releases") if isinstance(audit.get("releases"), Mapping) else {}
    caveats = [(str(r), c) for r, entry in releases.items() if isinstance(entry, Mapping)
               for c in entry.get("caveats") or []]
    if not weights and not caveats:
        return []
    out = ["### The weights on each runtime", ""]
    if weights:
        blobs = weights.get("blobs") or {}
        one, ptd = weights.get("gpu_bytes_one_copy"), weights.get("ptd_bytes")
        out.append(f"- `aoti_cuda_blob.ptd` is {_gib(ptd)}; the methods' weights blobs: "
                   + ", ".join(f"`{m}` {_gib(b)}" for m, b in blobs.items()) + ".")
        if len(blobs) > 1:
            stored = how_blobs_are_stored(weights.get("segments") or [], quote="`")
            out.append(f"- {stored[0].upper()}{stored[1:]}."
                       + f" With every method loaded, a runtime that gives each method its own copy holds "
                         f"{_gib(weights.get('gpu_bytes_each_method_own_copy'))} of weights on the GPU; one copy "
                         f"is {_gib(one)}.")
    out += [f"- ExecuTorch {release}: {text}" for release, text in caveats]
    # Measured, where verification ran the artifact on ExecuTorch's own runtime: what loading every method took.
    runtimes = verification.get("runtimes") if isinstance(verification, Mapping) else None
    et = runtimes.get("executorch") if isinstance(runtimes, Mapping) else None
    if isinstance(et, Mapping) and isinstance(et.get("gpu_loaded_mib"), (int, float)):
        runtime = " ".join(filter(None, ["ExecuTorch", et.get("release")]))
        out.append(f"- Measured: {runtime} took {et['gpu_loaded_mib']:.0f} MiB of GPU memory after loading every "
                   "method (zoo_runner, `cudaMemGetInfo` before and after).")
    return out + [""]


def _gib(n: Any) -> str:
    return f"{n / 2**30:.2f} GiB" if isinstance(n, (int, float)) else "?"


def verification_section(manifest: Mapping[str, Any]) -> List[str]:
    ver = manifest.get("verification") or {}
    gpu = (manifest.get("gpu") or {}).get("verified_on") or {}
    rows = ver.get("rows") or []
    out = ["## Verification", "",
           f"The shipped kernels and weights were run on {gpu_words(gpu)} with fresh seeded random inputs and "
           f"compared with eager PyTorch in the source's highest precision. Result: "
           f"**{'passed' if ver.get('passed') else 'FAILED'}** ({sum(1 for r in rows if r.get('ok'))} of "
           f"{len(rows)} comparisons within tolerance).", ""]
    if any(r.get("runtime") == "executorch" for r in rows):
        out += ["The artifact ran on two runtimes: torch's AOTI runner over each method's compiled `.so` and "
                "weights, and ExecuTorch's own C++ runtime with its CUDA backend, loading `model.pte` + "
                "`aoti_cuda_blob.ptd` as a deployment does.", ""]
    table = [["runtime", "method", "seed", "sizes", "output", "max abs diff", "relative L2", "cosine", "ok"]]
    for r in rows:
        table.append([RUNTIME_WORDS.get(r.get("runtime", "aoti"), r.get("runtime", "")), r.get("method", ""),
                      r.get("seed", ""), _sizes(r.get("sizes")), row_output(r),
                      _num(r.get("max_abs"), ".3e"), _num(r.get("rel_l2"), ".3e"), _num(r.get("cosine"), ".8f"),
                      "yes" if r.get("ok") else f"no: {r.get('why', '')}"])
    return out + [markdown_table(table), ""]


# How the card names the runtimes verification ran the artifact on (zoo.export.verify rows' "runtime").
RUNTIME_WORDS = {"aoti": "AOTI runner (libtorch)", "executorch": "ExecuTorch runtime"}


# Where each policy check ran, in the order the card shows them (zoo.export.policy_check records {"cpu": .., "gpu": ..}).
POLICY_CHECK_PLACES = (("cpu", "On the CPU, during export: the eager runner (the rewritten programs) against "
                               "LeRobot's policy in eager PyTorch."),
                       ("gpu", "On the GPU, after verification: the runner over the shipped kernels against "
                               "LeRobot's policy in eager PyTorch on the same GPU."))


def policy_check_section(manifest: Mapping[str, Any], note: Mapping[str, str]) -> List[str]:
    """The policy check: the runner against LeRobot's own select_action, over a sequence of action chunks
    (``note``: the family's entry of the card's family notes)."""
    family = (manifest.get("recipe") or {}).get("family", "")
    out = ["## Policy check", ""]
    if family not in runner_families():
        return out + [f"Not applicable: a {note.get('title', family)} has no action loop, so "
                      "there is no policy to drive; the verification above is the whole check.", ""]
    record = manifest.get("policy_check") or {}
    out += ["`zoo.runner` drove the artifact's methods the way LeRobot's policy drives its model and was compared "
            "with LeRobot's own `select_action`, built from the same checkpoint with the same seed, noise and a "
            "seeded synthetic sequence of observations (relative L2 of each action chunk; bf16 artifacts by zoo's "
            "bf16 rule against LeRobot in float32, over all the actions at once).", ""]
    for place, words in POLICY_CHECK_PLACES:
        part = record.get(place)
        if not part:
            out += [f"- {words} Not recorded.", ""]
            continue
        if "rows" not in part:
            out += [f"- {words} {str(part.get('status', 'skipped')).capitalize()}: {part.get('reason', '')}.", ""]
            continue
        rows = part.get("rows") or []
        out += [f"- {words} Result: **{'passed' if part.get('passed') else 'FAILED'}** "
                f"({sum(1 for r in rows if r.get('ok'))} of {len(rows)} chunks within tolerance, "
                f"{part.get('rule', 'float32')} rule, seed {part.get('seed')}).", ""]
        table = [["chunk", "actions", "max abs diff", "relative L2", "cosine", "bound", "ok"]]
        for r in rows:
            table.append([r.get("chunk", ""), r.get("steps", ""), _num(r.get("max_abs"), ".3e"),
                          _num(r.get("rel_l2"), ".3e"), _num(r.get("cosine"), ".8f"), _num(r.get("bound"), ".1e"),
                          "yes" if r.get("ok") else f"no: {r.get('why', '')}"])
        out += [markdown_table(table), ""]
        pooled = part.get("pooled")
        if pooled:  # the bf16 rule's verdict, over every action
            out += [f"  The bf16 rule over all {pooled['actions']} actions: relative L2 {pooled['rel_l2']:.3e} "
                    f"against LeRobot bf16's {pooled['reference_rel_l2']:.3e}, bound {pooled['bound']:.3e}, cosine "
                    f"{pooled['cosine']:.6f}: {'passed' if pooled['ok'] else 'FAILED'}. A chunk's own bound is "
                    "for reading.", ""]
    return out


def chunk_latency_section(manifest: Mapping[str, Any]) -> List[str]:
    """How long a whole action chunk takes, observation to actions: the recipe's measured entry
    (``zoo.contract.chunk_latency``), or that none was measured."""
    recipe = manifest.get("recipe") or {}
    if recipe.get("family", "") not in runner_families():
        return []
    name = recipe.get("name", "")
    out = ["## Speed of a whole action chunk", ""]
    entry = measured_for(name)
    if not entry:
        return out + [f"Not measured for the `{name}` recipe yet (`benchmarks/bench_chunk.py --record` on a GPU).", ""]
    ratios = entry.get("ratios") or {}
    out += [f"Measured for the `{name}` recipe on {entry.get('gpu')} ({entry.get('measured')}), {entry.get('dtype')}, "
            f"{entry.get('weights')}: the latency of a chunk depends on the architecture and sizes, not on the "
            "weights' values. One `select_action` call that predicts a chunk of "
            f"{entry.get('actions_per_chunk')} actions, everything from the observation to the actions (the VAE "
            "encode, every DiT step, classifier-free guidance, the host loop; the prompt's text embedding is made "
            f"once, outside). Command: `{entry.get('command')}`.", ""]
    labels = {"runner": "`zoo.runner` on this artifact (torch's AOTI runner)",
              "executorch": "`zoo.runner` on this artifact (ExecuTorch's runtime)",
              "graphs": "`zoo.runner` on this artifact, each method a CUDA graph (`cuda_graphs=True`)",
              "pytorch": "the strongest PyTorch: whole steps `torch.compile`d, CUDA graphs, state in place",
              "eager": "LeRobot's `select_action`, eager PyTorch",
              "compile": "LeRobot's `select_action`, DiT blocks `torch.compile`d"}
    table = [["", "ms per chunk: median (p10-p90)", "actions per second"]]
    for key, label in labels.items():
        c = (entry.get("candidates") or {}).get(key)
        table.append([label, f"{c['median_ms']:.1f} ({c['p10_ms']:.1f}-{c['p90_ms']:.1f})" if c else "not measured",
                      f"{c['actions_per_second']:.1f}" if c else "-"])
    if entry.get("floor_ms"):
        table.append(["the hardware floor (weights and state read once per call, at the measured bandwidth)",
                      f"{entry['floor_ms']:.1f}", "-"])
    out += [markdown_table(table), ""]
    named = {"runner/eager": "runner / eager", "runner/compile": "runner / torch.compile",
             "runner/pytorch": "runner / the strongest PyTorch", "executorch/runner": "ExecuTorch's runtime / runner",
             "runner/floor": "runner / floor", "graphs/runner": "CUDA graphs / runner",
             "graphs/pytorch": "CUDA graphs / the strongest PyTorch", "graphs/floor": "CUDA graphs / floor"}
    out += ["; ".join(f"{label}: {_num(ratios.get(key), '.2f')}" for key, label in named.items()
                      if key in ("runner/eager", "runner/compile") or ratios.get(key) is not None) + ".", ""]
    return out


def gpu_words(gpu: Mapping[str, Any]) -> str:
    if not gpu or not (gpu.get("name") or gpu.get("compute_capability")):
        return "a GPU that was not recorded"
    cap = gpu.get("compute_capability")
    sm = f" (compute capability {cap}, sm_{cap.replace('.', '')})" if cap else ""
    return f"{gpu.get('name') or 'an unnamed GPU'}{sm}"
