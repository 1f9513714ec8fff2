"""The chunk bench's tables and files: one row per policy and candidate, the ratios against their targets, the
roofline section, the policy check section, and ``chunk_latency.json`` / ``.md`` (or ``policy_check.*`` for
``--only check``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from zoo.bench.chunk import (CHECK_JSON_NAME, CHECK_MD_NAME, JSON_NAME, MD_NAME, TARGETS, fabricated_checkpoint)
from zoo.bench.chunk_runners import chunk_floor_of, floor_rows, split_rows
from zoo.core import atomic
from zoo.core.report import markdown_table

CANDIDATE_ORDER = ("runner", "executorch", "graphs", "pytorch", "eager", "compile")


def table_rows(results: Dict[str, Any]) -> List[List[str]]:
    """One row per policy and candidate: the chunk's median, actions per second, agreement with LeRobot eager,
    the chunk's floor and the ratio to it."""
    rows = [["policy", "candidate", "ms per chunk (p10, p90)", "actions/s", "vs LeRobot eager rel L2", "floor ms",
             "/floor"]]
    for r in results["policies"]:
        if r.get("status") == "checked":
            continue  # the policy check alone: its own section
        if r.get("status") != "done":
            rows.append([r["policy"], r.get("status", "?"), r.get("error", "")] + [""] * 4)
            continue
        for name in CANDIDATE_ORDER:
            c = r["candidates"].get(name)
            if c is None:
                continue
            depth = f", {r['layers']} layers" if r.get("layers") else ""
            rows.append([f"{r['policy']} ({r['dtype']}, {r['actions_per_chunk']} actions{depth})", name] + _cells(c))
    return rows


def _cells(c: Dict[str, Any]) -> List[str]:
    if c.get("error"):
        return [f"failed: {c['error']}"[:120], "", "", "", ""]
    s = c.get("chunk_ms")
    aps = c.get("actions_per_second")
    rel = c.get("vs_eager_rel_l2")
    floor = chunk_floor_of(c)
    return [f"{s['median']:.1f} ({s['p10']:.1f}, {s['p90']:.1f})" if s else "-", f"{aps:.1f}" if aps else "-",
            f"{rel:.2e}" if rel is not None else "-", f"{floor:.1f}" if floor else "-",
            f"{s['median'] / floor:.2f}x" if s and floor else "-"]


def ratio_lines(results: Dict[str, Any]) -> List[str]:
    """Each timed policy's ratios against their targets, one line each."""
    lines = []
    for r in results["policies"]:
        if r.get("status") != "done":
            continue
        parts = []
        for key, value in (r.get("ratios") or {}).items():
            if value is not None and key in TARGETS:
                parts.append(f"{key} {value:.2f}x ({'meets' if value <= TARGETS[key] else 'misses'} <= {TARGETS[key]})")
            elif value is not None:
                parts.append(f"{key} {value:.2f}x (lever)")
        lines.append(f"{r['policy']}: " + ("; ".join(parts) or "no ratio measured"))
    return lines


def write(results: Dict[str, Any], out: Path) -> None:
    """Both files, each replaced whole (the bench writes them after every candidate: a run killed mid-write keeps
    the previous ones)."""
    check_only = results["settings"]["only"] == "check"
    json_name, md_name = (CHECK_JSON_NAME, CHECK_MD_NAME) if check_only else (JSON_NAME, MD_NAME)
    atomic.write_json(out / json_name, results)
    env = results["environment"]
    title = ("Policy check of the lowered runs" if check_only
             else "Chunk latency: observation -> actions for one whole chunk")
    md = [f"# {title}", "",
          f"Command: `{results['command']}`", "",
          f"GPU: {env.get('gpu') or env.get('device')}; torch {env.get('torch')}; executorch {env.get('executorch')}.",
          ""] + ([] if check_only else [markdown_table(table_rows(results)), ""] + ratio_lines(results) + [""]
                 + roofline_section(results))
    md += policy_check_section(results)
    atomic.write_text(out / md_name, "\n".join(md))


def roofline_section(results: Dict[str, Any]) -> List[str]:
    """The rates the floors were worked out with, and the per-method table."""
    rates = results.get("rates")
    if not rates:
        return []
    return ["## The roofline: each call's floor", "",
            f"Measured in this run: device copy {rates['copy_gbps']:.0f} GB/s (read + written), dense "
            f"{rates['gemm']['dtype']} GEMM {rates['gemm_tflops']:.0f} TFLOP/s ({rates['gemm']['size']}^3). "
            "A call's floor is the larger of the bytes it must move (weights, inputs, outputs that are not state "
            "handed back) over the first and its FLOPs over the second (zoo.bench.roofline).", "",
            markdown_table(floor_rows(results)), ""] + split_section(results)


def split_section(results: Dict[str, Any]) -> List[str]:
    """Where a call on ExecuTorch's runtime spends the time the artifact runner does not (empty without one)."""
    rows = split_rows(results)
    if not rows:
        return []
    return ["## A call on ExecuTorch's runtime, part by part", "",
            "Each part is a median over the recorded calls: the runtime executing the method to a device "
            "synchronisation, the runtime binding inputs and taking outputs, the pipe and hand-over files between "
            "the two processes, and the Python session writing inputs and reading outputs "
            "(zoo.runtimes.executorch.CallTiming). The parts' medians need not add up to the call's.", "",
            markdown_table(rows), ""]


def policy_check_section(results: Dict[str, Any]) -> List[str]:
    """The markdown section of the policy checks that ran: verdict, rule and zoo's per-chunk table."""
    checked = [r for r in results["policies"] if r.get("policy_check")]
    if not checked:
        return []
    md = ["## Policy check: the runner against LeRobot's select_action (zoo.export.policy_check.check_run)", "",
          ("zoo's fabricated tiny checkpoints." if fabricated_checkpoint(results["settings"]) else
           "Seeded weights drawn in the unit's dtype, so LeRobot's bf16 and float32 policies and the lowered unit "
           "hold the same values.")
          + " A bf16 unit is judged by zoo's bf16 rule, a float32 one by its float32 tolerance.", ""]
    for r in checked:
        c = r["policy_check"]
        result = c.get("result") or {}
        md.append(f"### {r['policy']} ({r['dtype']}): {c['status'].upper()}"
                  + (f", {result.get('rule')} rule, {result.get('chunks')} chunks" if result else "")
                  + f" ({c.get('seconds')} s)")
        md += ["", "```", c.get("table") or c.get("error", ""), "```", ""]
    return md
