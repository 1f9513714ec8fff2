#!/usr/bin/env bash
# The GPU evidence of issues 12-14 in one held H200, started by one call and waited on by the next ones:
#
#   scripts/gpu_session.sh BUNDLE_DIR ET_SRC|- WORK [--jobs A,B,...] [--real RECIPE:METHODS] [--no-bench] [--chunk POLICY]   (returns once every job is started)
#   scripts/gpu_jobs.sh wait WORK 560; scripts/gpu_jobs.sh collect WORK $OUT real/summary.txt ...   (later calls)
#
# Jobs (scripts/gpu_jobs.sh; --jobs picks them, default real,runtime,tiny,tiny-et,real-et; ET_SRC may be - when
# no job builds the runtime). The real-size export is a session's long pole (about 20 minutes) of about 25 minutes
# of machine. Issue 12 asks for it alone on the machine; the default set runs the small jobs beside it at the
# lowest CPU priority (nice 19) to fit a session, and its profile's load timeline shows what ran beside it:
#   real      scripts/real_size.py on --real's recipe and methods (default lingbot-va:video_step,action_step)
#             under the sampling profiler (build, export, rewrite, parallel lowering, assembly, audit,
#             verification, bench, sizes), at normal priority; --no-bench leaves out its bench (the real-et job
#             times the methods on both runtimes itself)
#   runtime   (nice) scripts/build_runtime.sh ET_SRC WORK/runtime: ExecuTorch's C++ runtime + CUDA backend + zoo_runner
#   tiny      (nice) scripts/gpu_check.sh BUNDLE_DIR on the three tiny recipes and the float32-pair variants of
#             the two DiT recipes: exported, lowered, verified on torch's AOTI runner, policy-checked on the GPU
#   tiny-et   (nice) after runtime and tiny: scripts/gpu_runtime_check.py on those run folders: verification on
#             both runtimes (same inputs, seeds, sizes, tolerances) and LingBot-VA's 3-call KV pool sequence
#   real-et   after real and runtime: every method of the real-size run on zoo_runner against the AOTI runner,
#             each with all I/O on the GPU, with its state on the GPU (the rest through the host) and with all I/O
#             through the host (latency, GPU memory after loading), and every method loaded with weights shared
#             and not (scripts/gpu_runtime_check.py --latency all --memory)
#   tiny-bf16 after real (when real is a job): scripts/gpu_check.sh on the tiny LingBot-VA and Fast-WAM recipes
#             exported in bf16 (unit.dtype=bfloat16): verified under zoo's bf16 rule and policy-checked on the
#             GPU against LeRobot under the same rule (issue 13), alone on the machine
#   ptxas     first, before real and chunk-lower: scripts/ptxas_cache_check.py (a two-GEMM graph compiled as
#             Inductor is and as zoo's lowering is: does the lowering process find the autotuning choices the
#             compile pool built in Triton's cache?), about 4 minutes; WORK/ptxas holds its JSON
#   sdpa      first (after ptxas), before real and chunk-lower: scripts/triton_sdpa_check.py (the attention executorch's
#             Triton SDPA computes wrong, lowered as exported and after replace_triton_unsafe_sdpa_with_math),
#             about 2 minutes; WORK/sdpa holds its JSON
#   chunk     after real (when real is a job): scripts/bench_chunk.py on --chunk's policy (default fast_wam) in
#             three jobs, one after the other, alone on the machine (issue 13): chunk-lower (build, export, lower and
#             verify every method under the sampling profiler), chunk-check (zoo's policy check at real size, the artifact
#             runner against LeRobot under the bf16 rule), chunk-bench (whole-chunk latency: runner, LeRobot eager,
#             LeRobot torch.compile, recorded for the model card in the repo copy's zoo/data/chunk_latency.json,
#             copied to WORK/chunk/recorded_chunk_latency.json, beside the bench's own chunk_latency.json);
#             WORK/chunk holds their tables and JSON
# Every job writes its log under WORK/jobs/NAME and its tables and JSON under WORK; nothing here waits for them.
set -uo pipefail
usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 3 ] || usage
BUNDLE="$(cd "$1" && pwd)"; ET_SRC="$2"
[ "$ET_SRC" = - ] || ET_SRC="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
mkdir -p "$3"; WORK="$(cd "$3" && pwd)"
shift 3
JOBS=",real,runtime,tiny,tiny-et,real-et,"; REAL_SPEC="lingbot-va:video_step,action_step"; CHUNK_POLICY=fast_wam
REAL_BENCH=(--runs 10 --warmup 2)
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) JOBS=",$2,"; shift 2 ;;
    --real) REAL_SPEC="$2"; shift 2 ;;
    --no-bench) REAL_BENCH=(--no-bench); shift ;;
    --chunk) CHUNK_POLICY="$2"; shift 2 ;;
    *) echo "gpu_session: unknown option $1" >&2; usage ;;
  esac
done
for job in ${JOBS//,/ }; do
  case "$job" in real|runtime|tiny|tiny-et|real-et|tiny-bf16|chunk|ptxas|sdpa) ;; *) echo "gpu_session: unknown job $job" >&2; exit 2 ;; esac
done
want() { [[ "$JOBS" == *",$1,"* ]]; }
if want runtime && [ "$ET_SRC" = - ]; then echo "gpu_session: the runtime job needs ET_SRC (the ExecuTorch source tarball)" >&2; exit 2; fi
REAL_RECIPE="${REAL_SPEC%%:*}"; REAL_METHODS="${REAL_SPEC#*:}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
J=scripts/gpu_jobs.sh
SITE="$WORK/site"
RUNS="$WORK/runs"
RUNNER="$WORK/runtime/build/zoo_runner"
TINY=(llama-rope-tiny lingbot-va-tiny fast-wam-tiny lingbot-va-tiny+f32pairs fast-wam-tiny+f32pairs)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
# What the Python jobs run with (gpu_check.sh installs its own copy of the bundle for the tiny job).
cat > "$WORK/env.sh" <<EOF
export PYTHONPATH="$SITE:$REPO" FLATC_EXECUTABLE="$SITE/executorch/data/bin/flatc"
export HF_HUB_CACHE="$BUNDLE/hub" ZOO_TINY_HUB_CACHE="$BUNDLE/hub" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export ZOO_ET_RUNNER="$RUNNER"
EOF
in_env() { echo "source $WORK/env.sh && cd $REPO && $*"; }

# The real-size job imports from SITE from its first second: install it here, before anything starts.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "$BUNDLE"/wheels/*.whl || { echo "gpu_session: offline install failed" >&2; exit 2; }
chmod +x "$SITE/executorch/data/bin/flatc"
mkdir -p "$WORK/real" "$WORK/runs" "$WORK/chunk"
first=()
if want ptxas; then
  "$J" start "$WORK" ptxas --limit 900 -- bash -c "$(in_env python3 scripts/ptxas_cache_check.py --out "$WORK/ptxas")"
  first=(--after ptxas)
fi
if want sdpa; then
  "$J" start "$WORK" sdpa "${first[@]}" --limit 300 -- bash -c "$(in_env python3 scripts/triton_sdpa_check.py --out "$WORK/sdpa")"
  first=(--after sdpa)
fi
if want real; then
  "$J" start "$WORK" real "${first[@]}" --limit 1500 -- bash -c "$(in_env python3 -m zoo.sampling_profiler \
    --out "$WORK/real/profile.txt" scripts/real_size.py --out "$WORK/real" --recipe "$REAL_RECIPE" \
    --methods "$REAL_METHODS" ${REAL_BENCH[*]})"
fi
# 6 compile jobs: the real-size lowering holds most of the host's memory.
want runtime && "$J" start "$WORK" runtime --nice --limit 900 -- bash scripts/build_runtime.sh "$ET_SRC" "$WORK/runtime" --jobs 6
want tiny && "$J" start "$WORK" tiny --nice --limit 900 -- env ZOO_SITE="$WORK/check-site" ZOO_RUNS="$RUNS" \
  bash scripts/gpu_check.sh "$BUNDLE" "${TINY[@]}"
runs=(); for r in "${TINY[@]}"; do runs+=("$RUNS/$r"); done
want tiny-et && "$J" start "$WORK" tiny-et --after runtime,tiny --nice --limit 600 -- bash -c "$(in_env python3 scripts/gpu_runtime_check.py \
  "${runs[*]}" --runner "$RUNNER" --steps 3 --memory --policy-check --out "$WORK/runtime-check")"
want real-et && "$J" start "$WORK" real-et --after real,runtime --limit 1200 -- bash -c "$(in_env python3 scripts/gpu_runtime_check.py \
  "$WORK/real/run" --no-verify --steps 0 --latency all --memory --iters 20 --runner "$RUNNER" --out "$WORK/real-et")"
if want tiny-bf16; then
  after=(); want real && after=(--after real)
  "$J" start "$WORK" tiny-bf16 "${after[@]}" --limit 900 -- env ZOO_SITE="$WORK/check-site" ZOO_RUNS="$WORK/runs-bf16" \
    ZOO_EXPORT_ARGS="unit.dtype=bfloat16" bash scripts/gpu_check.sh "$BUNDLE" lingbot-va-tiny fast-wam-tiny
fi
if want chunk; then
  after=("${first[@]}"); want real && after=(--after real)
  bench_chunk=(scripts/bench_chunk.py --out "$WORK/chunk" --policies "$CHUNK_POLICY")
  chunk() { in_env python3 "${bench_chunk[@]}" "$@"; }
  # Each lowering worker writes its own sampled profile there (zoo.lowering_workers.ENV_PROFILE_DIR).
  "$J" start "$WORK" chunk-lower "${after[@]}" --limit 1500 -- bash -c "$(in_env env ZOO_LOWERING_PROFILE_DIR="$WORK/chunk/profiles" python3 -m zoo.sampling_profiler \
    --out "$WORK/chunk/lower-profile.txt" "${bench_chunk[@]}" --only lower)"
  "$J" start "$WORK" chunk-check --after chunk-lower --limit 900 -- bash -c "$(chunk --only check)"
  "$J" start "$WORK" chunk-bench --after chunk-check --limit 1200 -- bash -c "$(chunk --only bench --record) && cp zoo/data/chunk_latency.json \"$WORK/chunk/recorded_chunk_latency.json\""
fi
"$J" table "$WORK"
