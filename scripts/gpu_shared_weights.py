#!/usr/bin/env python3
"""GPU experiment for issue #12: methods lowered in parallel worker processes with one shared constant table,
assembled into one model.pte + aoti_cuda_blob.ptd whose shared weights are stored once.

    python scripts/gpu_shared_weights.py lower RUN_DIR OUT [--workers N] [--no-plan]
    python scripts/gpu_shared_weights.py check OUT [--verify]
    python scripts/gpu_shared_weights.py export-real OUT [--methods video_step,action_step]

``lower``: RUN_DIR is a run folder with ``rewritten.<method>.pt2`` (``python -m zoo.export lingbot-va-tiny``, or
``export-real``). Each method is lowered by ExecuTorch's CudaPartitioner in its own worker process
(``zoo.export.lower.workers``), with ``zoo.export.lower.constant_plan`` making every method's constant table the same
(``--no-plan``: today's tables, the control). OUT gets model.pte, aoti_cuda_blob.ptd, so/<method>.io.json, links
to RUN_DIR's other files, and summary.json (per-method times, the plan, each .so's constant table, and what
the .ptd holds: sizes and which keys share a segment).

``check``: reads OUT's .ptd index (which keys share a segment, bytes against the plan), then on the GPU
(1) loads every method's .so with its blob from the .ptd as the ExecuTorch 1.2 runtime does (each container
copies its blob into its own GPU allocation) and records free device memory after each load; (2) runs each
method on seeded inputs against the rewritten program in eager; (3) emulates ExecuTorch 1.3+'s
``weight_sharing_across_methods``: a second runner per method that loads no blob and points every constant at
the first method's tensors by FQN, runs, and is compared again. ``--verify`` also runs zoo's verification
(bf16 rule against float32) on OUT; it needs RUN_DIR's exported.* and reference_fp32.* programs.

``export-real``: the real-size LingBot-VA unit of scripts/bench_real_size.py (seeded random weights), exported,
rewritten and saved as a run folder for ``lower`` (~20 GB of programs; a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

from zoo.contract import artifact
from zoo.export.lower import assemble
from zoo.core import atomic
from zoo.export.lower import constant_plan
from zoo.export.lower import lowering
from zoo.export.lower import workers as lowering_workers
from zoo.contract import releases as runtimes  # noqa: E402
from zoo.export.lower.workers import LoweredMethod, MethodJob  # noqa: E402
from zoo.contract.run_folder import PROGRAM_KINDS, RunFolder  # noqa: E402


def say(message: str) -> None:
    print(f"[shared-weights] {message}", file=sys.stderr, flush=True)


# --- the worker's lowering of one method -------------------------------------------------------------------


def lower_cuda_method(method: str, program, options: Dict[str, Any]) -> LoweredMethod:
    """zoo's CUDA lowering of one method (what zoo.export.lower.lowering.lower_to_pte does per method), with the shared
    constant plan when the options carry one. A zoo.export.lower.workers function."""
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    plan = constant_plan.ConstantPlan.from_dict(options["constant_plan"]) if options.get("constant_plan") else None
    start = time.perf_counter()
    with lowering.inductor_settings(options.get("max_mm_configs")):
        follow = (constant_plan.inductor_follows_plan(plan, constant_plan.plan_values(program, plan)) if plan
                  else _no_plan())
        with follow as tables:
            edge = to_edge_transform_and_lower(
                {method: program},
                partitioner={method: [CudaPartitioner(runtimes.compile_specs(method, options["triton_kernel_mode"]))]},
                compile_config=EdgeCompileConfig(_check_ir_validity=False))
    io = lowering.delegate_io_order(edge.exported_program(method), method)
    io["output_names"] = list(program.graph_signature.user_outputs)
    return LoweredMethod(program=edge.to_executorch(),
                         record={"io": io, "constants": tables, "compile_seconds": time.perf_counter() - start})


class _no_plan:
    def __enter__(self):
        return []

    def __exit__(self, *exc):
        return False


# --- lower ----------------------------------------------------------------------------------------------------


def cmd_lower(args) -> int:
    run, out = RunFolder(Path(args.run_dir).resolve()), RunFolder(Path(args.out).resolve())
    recipe = run.load_recipe()
    methods = list(recipe.unit.methods)
    programs_paths = {m: run.program("rewritten", m) for m in methods}
    out.path.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    plan = None
    if not args.no_plan:
        programs = {m: torch.export.load(p) for m, p in programs_paths.items()}
        plan = constant_plan.plan_constants(programs)
        del programs
        say(f"plan: {len(plan.constants)} constants, {plan.nbytes / 2**20:.1f} MiB; private: {plan.private or 'none'}")
    plan_seconds = time.perf_counter() - start
    options = {"triton_kernel_mode": recipe.lowering.triton_kernel_mode,
               "max_mm_configs": recipe.lowering.max_mm_configs,
               "constant_plan": plan.as_dict() if plan else None}
    jobs = [MethodJob(m, programs_paths[m], options) for m in methods]
    pythonpath = os.pathsep.join([str(ROOT / "scripts"), *([args.pythonpath] if args.pythonpath else [])])
    assembled, parts = lowering_workers.lower_and_assemble(
        jobs, args.function, out.path / "workers", out.path, pte_name=artifact.PTE_NAME,
        max_workers=args.workers, env={"PYTHONPATH": pythonpath}, say=say)
    for m, part in parts.items():
        out.write_io_order(m, {"method": m, **part.record["io"]})
        for path in [part.pte, *part.data_files.values()]:  # assembled now; at real size each is ~10 GB of disk
            path.unlink()
    linked = [(run.recipe_file, out.recipe_file), (run.source_file, out.source_file),
              (run.io_spec_file, out.io_spec_file), (run.host_settings_file, out.host_settings_file),
              (run.processors_dir, out.processors_dir)]
    linked += [(run.program(k, m), out.program(k, m)) for k in PROGRAM_KINDS for m in methods]
    for src, dest in linked:
        if src.exists() and not dest.exists():
            dest.symlink_to(src)
    summary = {"run_dir": str(run.path), "plan": plan.as_dict() if plan else None, "plan_seconds": plan_seconds,
               "wall_seconds": time.perf_counter() - start,
               "methods": {m: {"seconds": p.seconds, "compile_seconds": p.record.get("compile_seconds"),
                               "constants": p.record["constants"], "log": str(p.log)} for m, p in parts.items()},
               "assembled": assembled.as_dict()}
    atomic.write_json(out.path / "summary.json", summary)
    ptd = assembled.data_files.get(artifact.PTD_NAME)
    say(f"lowered {', '.join(methods)} in {summary['wall_seconds']:.1f} s wall "
        f"({', '.join(f'{m} {p.seconds:.1f} s' for m, p in parts.items())})")
    if ptd is not None:
        say(f"{ptd.name}: {ptd.file_bytes / 2**20:.1f} MiB, segments {ptd.segments}, "
            f"{ptd.shared_bytes / 2**20:.1f} MiB stored once instead of twice"
            + (f"; plan {plan.nbytes / 2**20:.1f} MiB -> {ptd.file_bytes / plan.nbytes:.3f}x" if plan else ""))
    return 0


# --- check ----------------------------------------------------------------------------------------------------


def _free_mib(device: str) -> float:
    """Free device memory (CUDA); 0 on the CPU, where a dry run of ``check`` measures nothing."""
    if device != "cuda":
        return 0.0
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**20


def _runner(so: Path, device: str):
    if device == "cuda":
        return torch._C._aoti.AOTIModelContainerRunnerCuda(str(so), 1, device)
    return torch._C._aoti.AOTIModelContainerRunnerCpu(str(so), 1)


def extract_once(pte: Path, index, methods: List[str], folder: Path) -> Dict[str, Dict[str, Path]]:
    """Each method's .so from the .pte and its weights from the .ptd, one file per distinct .ptd segment (the
    runner wants a path; two methods naming one segment share the file)."""
    programs = artifact.read_pte_file(pte)
    folder.mkdir(parents=True, exist_ok=True)
    by_key = {e.key: e for e in index}
    written: Dict[tuple, Path] = {}
    files = {}
    for m in methods:
        so = folder / f"{m}.so"
        so_entry = programs.named_data.pte_data[m + artifact.SO_SUFFIX]
        so.write_bytes(programs.named_data.buffers[so_entry.buffer_index])
        entry = by_key[m + artifact.WEIGHTS_SUFFIX]
        where = (entry.offset, entry.size)
        if where not in written:
            written[where] = folder / artifact.weights_file_name(m)
            with open(written[where], "wb") as dst:
                for chunk in assemble.entry_chunks(entry):
                    dst.write(chunk)
        files[m] = {"so": so, "weights": written[where]}
    return files


def cmd_check(args) -> int:
    from zoo.core import numerics
    from zoo.runtimes.aoti import promote_libtorch_global
    from zoo.policies.base import InputSpec
    from zoo.export.verify import draw_inputs, run_in_delegate_order

    out = RunFolder(Path(args.out).resolve())
    recipe = out.load_recipe()
    methods = list(recipe.unit.methods)
    result: Dict[str, Any] = {"ptd": {}, "memory_mib": {}, "outputs": {}}
    pte = out.pte
    ptd = out.ptd if args.device == "cuda" else out.path / args.ptd
    index = assemble.read_data_file(ptd)
    result["ptd"] = {"file_mib": ptd.stat().st_size / 2**20,
                     "entries": {e.key: {"offset": e.offset, "mib": e.size / 2**20} for e in index},
                     "keys_sharing_one_segment": len({e.offset for e in index}) < len(index)}
    say(f"{ptd.name}: {json.dumps(result['ptd'])}")

    promote_libtorch_global()
    files = extract_once(pte, index, methods, out.path / "check")
    io_spec = out.read_io_spec()
    sizes = io_spec.get("example_sizes", {})
    device = args.device
    if device == "cuda":
        torch.cuda.empty_cache()
    free0 = _free_mib(device)
    runners = {}
    for m in methods:
        runners[m] = _runner(files[m]["so"], device)
        runners[m].update_constant_buffer_from_blob(str(files[m]["weights"]))
        result["memory_mib"][f"after loading {m} (1.2: own copy)"] = free0 - _free_mib(device)
    say(f"device memory taken, each method loading its own blob: {result['memory_mib']}")

    def compare(m: str, runner) -> Dict[str, Any]:
        specs = [InputSpec(**d) for d in io_spec["methods"][m]["inputs"]]
        used = {d: sizes[d] for s in specs for d in s.shape if isinstance(d, str)}
        inputs = [t.to(device) for t in draw_inputs(specs, used, 0, m)]
        order = out.io_order(m)
        eager = out.load_program("rewritten", m).module().to(device)
        with torch.no_grad():
            want = eager(*inputs)
            want = list(want) if isinstance(want, (tuple, list)) else [want]
            got = run_in_delegate_order(runner, order, inputs)
        return {name: {k: v for k, v in numerics.compare(name, g, w).as_dict().items()
                       if k in ("max_abs", "rel_l2", "cosine")}
                for name, g, w in zip(order["output_names"], got, want)}

    for m in methods:
        result["outputs"][f"{m} (own blob)"] = compare(m, runners[m])
    # ExecuTorch 1.3+ with weight_sharing_across_methods: the first method's constants, by FQN, for the others.
    first = methods[0]
    by_fqn = runners[first].extract_constants_map(False)
    for m in methods[1:]:
        free_before = _free_mib(device)
        shared = _runner(files[m]["so"], device)
        names = shared.get_constant_names_to_original_fqns()
        missing = sorted(fqn for fqn in names.values() if fqn not in by_fqn)
        if missing:
            result["outputs"][f"{m} (1.3 sharing)"] = f"not shareable: {len(missing)} constants not in {first}"
            continue
        shared.update_constant_buffer({name: by_fqn[fqn] for name, fqn in names.items()}, False, False, True)
        result["memory_mib"][f"{m} on {first}'s weights (1.3 sharing)"] = free_before - _free_mib(device)
        result["outputs"][f"{m} (1.3 sharing)"] = compare(m, shared)
    say(f"outputs: {json.dumps(result['outputs'], indent=1)}")
    say(f"memory: {json.dumps(result['memory_mib'], indent=1)}")
    if args.verify:
        from zoo.export.verify import verify_artifact

        verified = verify_artifact(out, recipe, raise_on_failure=False, runtimes=["aoti"])
        result["verification"] = {"ok": verified.ok, "table": verified.table()}
        say(f"zoo verification: {'PASS' if verified.ok else 'FAIL'}\n{verified.table()}")
    atomic.write_json(out.path / "check.json", result)
    return 0


# --- export-real ----------------------------------------------------------------------------------------------


def cmd_export_real(args) -> int:
    import tempfile

    import bench_real_size as brs

    from zoo.export import trace as exporting
    from zoo.export import pipeline

    out = RunFolder(Path(args.out).resolve())
    out.path.mkdir(parents=True, exist_ok=True)
    spec = brs.parse_unit(f"lingbot_va:{args.methods}" if args.methods else "lingbot_va")
    recipe = brs.unit_recipe(spec, tiny=False)
    if spec.methods:
        recipe.unit.methods = list(spec.methods)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zoo-shared-build-") as work:
        unit = brs.build_unit(spec, recipe, Path(work))
    say(f"built in {time.perf_counter() - start:.1f} s")
    out.write_recipe(recipe)
    out.write_io_spec(pipeline.io_spec(unit, recipe))
    sizes = exporting.example_sizes(recipe)
    for m in recipe.unit.methods:
        t = time.perf_counter()
        program = pipeline.apply_rewrites(exporting.export_method(unit.methods[m], recipe, sizes), recipe, m)[0]
        out.save_program(program, "rewritten", m)
        say(f"{m}: exported, rewritten and saved in {time.perf_counter() - t:.1f} s")
    return 0


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("lower")
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--no-plan", action="store_true")
    p.add_argument("--function", default="gpu_shared_weights:lower_cuda_method",
                   help="the per-method lowering (a CPU dry run: aoti_cpu_probe:lower_probe with "
                        "--pythonpath tests/fixtures)")
    p.add_argument("--pythonpath", default="")
    p = sub.add_parser("check")
    p.add_argument("out")
    p.add_argument("--verify", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a dry run on a lowering made with the CPU probe (no memory figures)")
    p.add_argument("--ptd", default="aoti_cpu_blob.ptd", help="with --device cpu: the probe's .ptd name")
    p = sub.add_parser("export-real")
    p.add_argument("out")
    p.add_argument("--methods", default="")
    args = parser.parse_args(argv)
    return {"lower": cmd_lower, "check": cmd_check, "export-real": cmd_export_real}[args.cmd](args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
