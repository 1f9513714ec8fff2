"""``python -m zoo bench RUN_DIR``: how fast the artifact runs, against eager PyTorch and torch.compile.

The package's modules (measuring, rendering, candidates, rotary, cli; seeded and chunk for benchmarks/) are
listed in docs/ARCHITECTURE.md; the names below are the package's interface
(``from zoo import bench; bench.render(...)``).
"""

from __future__ import annotations

from zoo.bench.candidates import (
    INPUT_SEED,
    ArtifactMethod,
    Candidate,
    RunFn,
    agreement,
    artifact_candidate,
    auto_input_sets,
    bench_candidate,
    bench_method,
    carried_inputs,
    carried_state_cost,
    draw_inputs,
    error_line,
    indexed_device,
    input_specs,
    kernel_kind,
    load_program_module,
    module_runner,
    parse_sizes,
    run_folder_candidates,
    set_bytes,
    size_cases,
    top_kernels,
)
from zoo.bench.cli import (
    COST_STAGES,
    artifact_sizes,
    build_parser,
    check_counts,
    export_cost,
    load_io_spec,
    main,
    resolve_device,
    run_name,
)
from zoo.bench.measuring import (
    MIB,
    CudaEventTimer,
    PeakMemory,
    PerfCounterTimer,
    Stats,
    environment,
    measure,
    measure_device_time,
    percentile,
    timer_for,
)
from zoo.bench.rendering import (
    BENCH_JSON,
    BENCH_MD,
    FORMAT,
    TARGETS,
    UNIT_STAGES,
    Targets,
    carried_rows,
    cost_rows,
    judge_at_least,
    judge_at_most,
    judge_method,
    kernel_rows,
    latency_rows,
    missed_targets,
    ratios,
    render,
    rotary_rows,
    units_rows,
    write_results,
)

__all__ = [
    "ArtifactMethod", "BENCH_JSON", "BENCH_MD", "COST_STAGES", "Candidate", "CudaEventTimer", "FORMAT",
    "INPUT_SEED", "MIB", "PeakMemory", "PerfCounterTimer", "RunFn", "Stats", "TARGETS", "Targets", "UNIT_STAGES",
    "agreement", "artifact_candidate", "artifact_sizes", "auto_input_sets", "bench_candidate", "bench_method",
    "build_parser", "carried_inputs", "carried_rows", "carried_state_cost", "check_counts", "cost_rows",
    "draw_inputs", "environment", "error_line", "export_cost", "indexed_device", "input_specs", "judge_at_least",
    "judge_at_most", "judge_method", "kernel_rows", "latency_rows", "load_io_spec", "load_program_module", "main",
    "measure", "measure_device_time", "missed_targets", "module_runner", "parse_sizes", "percentile", "ratios",
    "render", "rotary_rows", "run_folder_candidates", "run_name", "set_bytes", "size_cases", "timer_for",
    "top_kernels", "kernel_kind", "units_rows", "write_results",
]
