"""What a bench result means and how it reads: the project's targets, the judgements against them, the tables
(Markdown or fixed-width text) and the JSON/Markdown files. Plain Python over result dicts: no device needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from zoo.core import atomic
from zoo.contract.artifact import PTD_NAME, PTE_NAME
from zoo.core.report import format_table, markdown_table
from zoo.bench.measuring import MIB

FORMAT = "zoo-bench/1"
BENCH_JSON = "bench.json"
BENCH_MD = "bench.md"


# ------------------------------------------------------------------------------------------------------
# Targets and judgements


@dataclass(frozen=True)
class Targets:
    artifact_vs_eager: float = 0.7  # artifact latency at most this fraction of eager's
    artifact_vs_compile: float = 1.05  # ... and at most this multiple of torch.compile's
    memory_vs_eager: float = 1.0  # artifact peak GPU memory at most eager's
    rotary_copy_fraction: float = 0.70  # rotary bandwidth at least this fraction of device copy bandwidth


TARGETS = Targets()


def judge_at_most(value: Optional[float], limit: float) -> Dict[str, Any]:
    """A ratio that should be <= ``limit``; when it is not, by how much (percent of the limit) it misses."""
    if value is None or not math.isfinite(value):
        return {"value": value, "limit": limit, "ok": None, "text": "not measured"}
    if value <= limit:
        return {"value": value, "limit": limit, "ok": True, "text": f"met ({value:.2f} <= {limit:.2f})"}
    return {"value": value, "limit": limit, "ok": False,
            "text": f"missed by {_percent((value / limit - 1.0) * 100)} ({value:.2f} > {limit:.2f})"}


def judge_at_least(value: Optional[float], limit: float) -> Dict[str, Any]:
    """A fraction that should be >= ``limit``; when it is not, by how much (percent of the limit) it misses."""
    if value is None or not math.isfinite(value):
        return {"value": value, "limit": limit, "ok": None, "text": "not measured"}
    if value >= limit:
        return {"value": value, "limit": limit, "ok": True, "text": f"met ({value:.2f} >= {limit:.2f})"}
    return {"value": value, "limit": limit, "ok": False,
            "text": f"missed by {_percent((1.0 - value / limit) * 100)} ({value:.2f} < {limit:.2f})"}


def _percent(p: float) -> str:
    return f"{p:.1f}%" if p < 10 else f"{p:.0f}%"


def ratios(candidates: Dict[str, Dict[str, Any]]) -> Dict[str, Optional[float]]:
    def median(name: str) -> Optional[float]:
        stats = (candidates.get(name) or {}).get("stats")
        return stats["median"] if stats else None

    art, eager, comp = median("artifact"), median("eager"), median("compile")
    return {"artifact/eager": art / eager if art is not None and eager else None,
            "artifact/compile": art / comp if art is not None and comp else None}


def judge_method(candidates: Dict[str, Dict[str, Any]], targets: Targets = TARGETS) -> Dict[str, Any]:
    r = ratios(candidates)
    art_peak = (candidates.get("artifact") or {}).get("peak_bytes")
    eager_peak = (candidates.get("eager") or {}).get("peak_bytes")
    memory = art_peak / eager_peak if art_peak is not None and eager_peak else None
    return {"ratios": {**r, "memory artifact/eager": memory},
            "targets": {"artifact/eager": judge_at_most(r["artifact/eager"], targets.artifact_vs_eager),
                        "artifact/compile": judge_at_most(r["artifact/compile"], targets.artifact_vs_compile),
                        "memory artifact/eager": judge_at_most(memory, targets.memory_vs_eager)}}


# ------------------------------------------------------------------------------------------------------
# Rendering


def _ms(stats: Optional[Dict[str, float]]) -> str:
    if not stats:
        return ""
    return f"{stats['median']:.3f} [{stats['p10']:.3f}-{stats['p90']:.3f}]"


def _cell(rec: Dict[str, Any]) -> str:
    if "skipped" in rec:
        return f"skipped: {rec['skipped']}"
    if "error" in rec:
        return f"FAILED: {rec['error']}"
    return _ms(rec.get("stats"))


def _mib(n: Optional[int]) -> str:
    return "" if n is None else f"{n / MIB:.1f}"


def _sizes(sizes: Dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) or "-"


def _ratio_cell(judgement: Dict[str, Any]) -> str:
    value = judgement.get("value")
    if judgement.get("ok") is None:
        return "-"
    head = f"{value:.2f}"
    return f"{head} ok" if judgement["ok"] else f"{head} {judgement['text'].split(' (')[0]}"


def latency_rows(results: Sequence[Dict[str, Any]]) -> List[List[str]]:
    t = TARGETS
    rows = [["method", "sizes", "artifact ms", "eager ms", "compile ms",
             f"artifact/eager (<= {t.artifact_vs_eager:g})", f"artifact/compile (<= {t.artifact_vs_compile:g})",
             "peak MiB artifact", "peak MiB eager", f"memory (<= {t.memory_vs_eager:g}x eager)",
             "artifact vs eager"]]
    for r in results:
        c = r["candidates"]
        name = f"{r['unit']}: {r['method']}" if r.get("unit") else r["method"]
        agree = (r.get("agreement") or {}).get("artifact") or {}
        agree_text = ("" if not agree else agree.get("error") or
                      f"rel L2 {agree['worst_rel_l2']:.1e}, cos {agree['min_cosine']:.5f}")
        rows.append([name, _sizes(r["sizes"]), _cell(c.get("artifact", {})), _cell(c.get("eager", {})),
                     _cell(c.get("compile", {})), _ratio_cell(r["targets"]["artifact/eager"]),
                     _ratio_cell(r["targets"]["artifact/compile"]), _mib(c.get("artifact", {}).get("peak_bytes")),
                     _mib(c.get("eager", {}).get("peak_bytes")), _ratio_cell(r["targets"]["memory artifact/eager"]),
                     agree_text])
    return rows


def kernel_rows(results: Sequence[Dict[str, Any]]) -> List[List[str]]:
    rows = [["method", "sizes", "candidate", "kernel", "ms per call", "launches per call", "share"]]
    for r in results:
        name = f"{r['unit']}: {r['method']}" if r.get("unit") else r["method"]
        for cand, rec in r["candidates"].items():
            for k in rec.get("top_kernels") or []:
                rows.append([name, _sizes(r["sizes"]), cand, k["kernel"], f"{k['ms_per_call']:.3f}",
                             f"{k['launches_per_call']:g}", f"{100 * k['share']:.0f}%"])
    return rows


def carried_rows(carried: Sequence[Dict[str, Any]]) -> List[List[str]]:
    rows = [["method", "sizes", "carried inputs", "MiB", "copy ms", "share of artifact latency"]]
    for r in carried:
        name = f"{r['unit']}: {r['method']}" if r.get("unit") else r["method"]
        share = r.get("fraction_of_artifact")
        rows.append([name, _sizes(r["sizes"]), ", ".join(r["inputs"]), _mib(r["bytes"]),
                     f"FAILED: {r['error']}" if r.get("error") else _ms(r.get("copy")),
                     "" if share is None else f"{100 * share:.1f}%"])
    return rows


def rotary_rows(rotary: Sequence[Dict[str, Any]]) -> List[List[str]]:
    rows = [["case", "shape", "dtype", "eager complex ms", "real pairs ms", "speedup", "GB/s",
             f"of copy BW (>= {TARGETS.rotary_copy_fraction:.0%})"]]
    for r in rotary:
        j = r["target"]
        frac = "-" if j.get("ok") is None else (f"{j['value']:.1%} ok" if j["ok"] else
                                                f"{j['value']:.1%} {j['text'].split(' (')[0]}")
        rows.append([r["case"], "x".join(str(s) for s in r["shape"]), r["dtype"], _ms(r["eager"]["stats"]),
                     _ms(r["pairs"]["stats"]), f"{r['speedup']:.2f}x", f"{r['pairs_gbps']:.1f}", frac])
    return rows


def cost_rows(cost: Dict[str, Optional[float]], sizes: Dict[str, int]) -> List[List[str]]:
    rows = [["stage", "seconds"]] + [[k, "-" if v is None else f"{v:.1f}"] for k, v in cost.items()]
    rows += [[f"size of {name}", f"{n / MIB:.1f} MiB"] for name, n in sizes.items()]
    return rows


UNIT_STAGES = ("build", "export", "rewrite", "lower", "verify", "bench")


def units_rows(units: Sequence[Dict[str, Any]]) -> List[List[str]]:
    """Per unit: seconds per stage (or why it did not run) and the artifact files' sizes."""
    rows = [["unit", "status"] + [f"{s} s" for s in UNIT_STAGES] + [f"{PTE_NAME} MiB", ".ptd MiB", ".so MiB"]]
    for u in units:
        cells = []
        for s in UNIT_STAGES:
            st = (u.get("stages") or {}).get(s) or {}
            cells.append(f"{st['seconds']:.1f}" if st.get("seconds") is not None and st.get("status") == "done"
                         else st.get("status", "-"))
        sizes = u.get("artifact_sizes") or {}
        so = sum(n for k, n in sizes.items() if k.endswith(".so"))
        rows.append([u["unit"], u.get("status", "?")] + cells +
                    [_mib(sizes.get(PTE_NAME)), _mib(sizes.get(PTD_NAME)), _mib(so or None)])
    return rows


def render(result: Dict[str, Any], markdown: bool = True) -> str:
    """The bench result as Markdown (``markdown=True``) or as fixed-width text for the terminal."""
    table = markdown_table if markdown else format_table

    def heading(title: str) -> List[str]:
        return [f"## {title}", ""] if markdown else [title]

    env = result.get("environment") or {}
    s = result.get("settings") or {}
    where = env.get("gpu") or env.get("cpu") or env.get("device")
    out = [f"# zoo bench: {result.get('name', '?')}", ""] if markdown else []
    out += [f"{where}; torch {env.get('torch')}, CUDA {env.get('cuda')}, executorch {env.get('executorch')}; "
            f"{s.get('runs')} timed calls after {s.get('warmup')} warm-up, timer {s.get('timer')}; "
            "times are median [p10-p90] ms per call", ""]
    if result.get("command"):
        out += [f"command: `{result['command']}`" if markdown else f"command: {result['command']}", ""]
    if result.get("methods"):
        out += heading("Latency") + [table(latency_rows(result["methods"])), ""]
        seen: List[str] = []
        for r in result["methods"]:
            for name, what in (r.get("what") or {}).items():
                line = f"{name}: {what}"
                if what and line not in seen:
                    seen.append(line)
        out += [("- " if markdown else "") + line for line in seen] + [""]
    kernels = kernel_rows(result.get("methods") or [])
    if len(kernels) > 1:
        out += heading("Where the device time goes (top kernels per call, CUDA profiler)") + [table(kernels), ""]
    if result.get("carried_state"):
        out += heading("State passed in and out (per call, against an in-place buffer)") + [
            table(carried_rows(result["carried_state"])), "",
            "The method returns each carried input updated as a new tensor, so every call writes it whole; the "
            "copy column times exactly that write (clone() of the inputs) alone.", ""]
    if result.get("rotary"):
        copy = result.get("copy_bandwidth") or {}
        out += heading("Rotary embedding alone") + [table(rotary_rows(result["rotary"])), ""]
        launched = [[r["case"], k["kernel"], f"{k['launches_per_call']:g}", f"{1e3 * k['ms_per_call']:.1f}"]
                    for r in result["rotary"] for k in (r.get("pairs_kernels") or [])[1:]]
        if launched:
            out += [table([["case", "real-pair kernel", "launches per call", "us per call"]] + launched), ""]
        timings = sorted({r["timing"] for r in result["rotary"] if r.get("timing")})
        if timings:
            out += [f"rotary times are device times per call: {'; '.join(timings)}", ""]
        if copy:
            out += [f"device copy bandwidth {copy['gbps']:.1f} GB/s (copy_ of {copy['bytes'] / 2**30:.2f} GiB, "
                    "bytes read + written per copy over its median time)", ""]
    if result.get("units"):
        out += heading("Export cost per stage and artifact sizes") + [table(units_rows(result["units"])), ""]
        out += [f"- {u['unit']} failed: {u['error']}" for u in result["units"] if u.get("error")]
        out += [""] if any(u.get("error") for u in result["units"]) else []
    if result.get("export_cost") or result.get("artifact_sizes"):
        out += heading("Export cost and artifact sizes") + [
            table(cost_rows(result.get("export_cost") or {}, result.get("artifact_sizes") or {})), ""]
    missed = missed_targets(result)
    if missed:
        out += heading("Targets missed") + [f"- {m}" for m in missed] + [""]
    return "\n".join(out)


def missed_targets(result: Dict[str, Any]) -> List[str]:
    missed = []
    for r in result.get("methods") or []:
        for key, j in r["targets"].items():
            if j.get("ok") is False:
                who = f"{r['unit']}: {r['method']}" if r.get("unit") else r["method"]
                missed.append(f"{who} ({_sizes(r['sizes'])}) {key}: {j['text']}")
    for r in result.get("rotary") or []:
        if r["target"].get("ok") is False:
            missed.append(f"rotary {r['case']}: fraction of copy bandwidth {r['target']['text']}")
    return missed


def write_results(result: Dict[str, Any], json_path: Path, md_path: Optional[Path]) -> None:
    atomic.write_json(json_path, _finite(result))
    if md_path is not None:
        atomic.write_text(md_path, render(result, markdown=True) + "\n")


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
