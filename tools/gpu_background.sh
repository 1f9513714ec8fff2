#!/usr/bin/env bash
# The GPU measurements of docs/gpu-results.md on one offline GPU box, started as background jobs that outlive
# this command (tools/gpu_jobs.sh); it returns once every job is started:
#
#   tools/gpu_background.sh BUNDLE_DIR ET_SRC|- WORK [--jobs A,B,...] [--real RECIPE:METHODS] [--chunk POLICY]
#                           [--chunk-set KEY=VALUE ...]  (a recipe override for the chunk job, once per override)
#   tools/gpu_jobs.sh wait WORK 600; tools/gpu_jobs.sh collect WORK OUT real/summary.txt ...   (later)
#
# BUNDLE_DIR: made by `python -m zoo bundle`. ET_SRC: what scripts/build_runtime.sh builds ExecuTorch's runtime
# from (a source tree, a tag such as v1.2.0, or a source tarball); - when no job builds it. Jobs (--jobs picks
# them, default real,runtime,tiny,tiny-et,real-et). A real-size lowering is the long pole (10-15 minutes); the
# small jobs run beside it at the lowest CPU priority (nice 19), which its profile's load timeline shows. For
# lowering times to quote, run real (or chunk) alone: --jobs real.
#   real      benchmarks/real_size.py on --real's recipe and methods (default lingbot-va:video_step,action_step)
#             under the sampling profiler (build, export, rewrite, parallel lowering, assembly, audit,
#             verification, bench, sizes), at normal priority
#   runtime   (nice) scripts/build_runtime.sh ET_SRC WORK/runtime: ExecuTorch's C++ runtime + CUDA backend + zoo_runner
#   tiny      (nice) tools/gpu_check.sh BUNDLE_DIR on the three tiny recipes and the float32-pair variants of
#             the two DiT recipes: exported, lowered, verified on torch's AOTI runner, policy-checked on the GPU
#   tiny-et   (nice) after runtime and tiny: benchmarks/gpu_runtime_check.py on those run folders: verification
#             on both runtimes (same inputs, seeds, sizes, tolerances) and LingBot-VA's 3-call KV pool sequence
#   real-et   after real and runtime: action_step of the real-size run on zoo_runner against the AOTI runner
#             (latency, GPU memory after loading)
#   tiny-bf16 after real (when real is a job): tools/gpu_check.sh on the tiny LingBot-VA and Fast-WAM recipes
#             exported in bf16 (unit.dtype=bfloat16): verified under zoo's bf16 rule and policy-checked on the
#             GPU against LeRobot under the same rule, alone on the machine
#   chunk     after real (when it is a job): benchmarks/bench_chunk.py on --chunk's policy (default fast_wam),
#             one job after the other, alone on the machine: chunk-lower (build, export, lower and verify every
#             method on torch's AOTI runner, under the sampling profiler; beside the runtime build), chunk-check
#             (zoo's policy check at real size, through ExecuTorch's runtime when the runtime job is there, else
#             the artifact runner), then chunk-bench (whole-chunk latency: the runner, the runner on ExecuTorch's
#             runtime, the runner with CUDA graphs, LeRobot eager, the strongest PyTorch, each runner with its
#             roofline; recorded for the model card in the checkout's zoo/data/chunk_latency.json, copied to
#             WORK/chunk/recorded_chunk_latency.json), then, with zoo_runner, chunk-methods (the DiT methods'
#             latency on both runtimes: LingBot-VA's video_step and action_step, Fast-WAM's prefill and action_step; the GPU memory after loading and its peak over the calls,
#             benchmarks/gpu_runtime_check.py); WORK/chunk holds their tables and JSON. The lowering needs ~52 GB of free disk at LingBot-VA's size (it says so
#             before compiling when there is less)
# Every job writes its log under WORK/jobs/NAME and its tables and JSON under WORK; nothing here waits for them.
set -uo pipefail
usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 3 ] || usage
BUNDLE="$(cd "$1" && pwd)"; ET_SRC="$2"
# A path is made absolute (the jobs run from the checkout); a tag is passed on as it is.
[ "$ET_SRC" = - ] || [ ! -e "$ET_SRC" ] || ET_SRC="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
mkdir -p "$3"; WORK="$(cd "$3" && pwd)"
shift 3
JOBS=",real,runtime,tiny,tiny-et,real-et,"; REAL_SPEC="lingbot-va:video_step,action_step"; CHUNK_POLICY=fast_wam
CHUNK_SET=()
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) JOBS=",$2,"; shift 2 ;;
    --real) REAL_SPEC="$2"; shift 2 ;;
    --chunk) CHUNK_POLICY="$2"; shift 2 ;;
    --chunk-set) CHUNK_SET+=("$2"); shift 2 ;;
    *) echo "gpu_background: unknown option $1" >&2; usage ;;
  esac
done
for job in ${JOBS//,/ }; do
  case "$job" in real|runtime|tiny|tiny-et|real-et|tiny-bf16|chunk) ;; *) echo "gpu_background: unknown job $job" >&2; exit 2 ;; esac
done
want() { [[ "$JOBS" == *",$1,"* ]]; }
if want runtime && [ "$ET_SRC" = - ]; then
  echo "gpu_background: the runtime job needs ET_SRC (an ExecuTorch source tree, tag or tarball)" >&2; exit 2
fi
REAL_RECIPE="${REAL_SPEC%%:*}"; REAL_METHODS="${REAL_SPEC#*:}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
J=tools/gpu_jobs.sh
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
  "$BUNDLE"/wheels/*.whl || { echo "gpu_background: offline install failed" >&2; exit 2; }
chmod +x "$SITE/executorch/data/bin/flatc"
mkdir -p "$WORK/real" "$WORK/runs" "$WORK/chunk"
if want real; then
  "$J" start "$WORK" real --limit 1500 -- bash -c "$(in_env python3 -m zoo.core.sampling_profiler \
    --out "$WORK/real/profile.txt" benchmarks/real_size.py --out "$WORK/real" --recipe "$REAL_RECIPE" \
    --methods "$REAL_METHODS" --runs 10 --warmup 2)"
fi
if want runtime; then
  src=("$ET_SRC"); [ -f "$ET_SRC" ] && src=(--tarball "$ET_SRC")
  # 6 compile jobs beside a real-size lowering's compile workers, which hold most of the host's memory; beside the
  # chunk job's lowering it takes every core at low priority, done (~1 min) while that lowering still builds the
  # policy on one core.
  build_jobs=6; want real || build_jobs="$(nproc)"
  "$J" start "$WORK" runtime --nice --limit 900 -- bash scripts/build_runtime.sh "${src[@]}" "$WORK/runtime" --jobs "$build_jobs"
fi
want tiny && "$J" start "$WORK" tiny --nice --limit 900 -- env ZOO_SITE="$WORK/check-site" ZOO_RUNS="$RUNS" \
  bash tools/gpu_check.sh "$BUNDLE" "${TINY[@]}"
runs=(); for r in "${TINY[@]}"; do runs+=("$RUNS/$r"); done
want tiny-et && "$J" start "$WORK" tiny-et --after runtime,tiny --nice --limit 600 -- bash -c "$(in_env python3 \
  benchmarks/gpu_runtime_check.py "${runs[*]}" --runner "$RUNNER" --steps 3 --out "$WORK/runtime-check")"
want real-et && "$J" start "$WORK" real-et --after real,runtime --limit 600 -- bash -c "$(in_env python3 \
  benchmarks/gpu_runtime_check.py "$WORK/real/run" --no-verify --steps 0 --latency action_step --runner "$RUNNER" \
  --out "$WORK/real-et")"
if want tiny-bf16; then
  after=(); want real && after=(--after real)
  "$J" start "$WORK" tiny-bf16 "${after[@]}" --limit 900 -- env ZOO_SITE="$WORK/check-site" ZOO_RUNS="$WORK/runs-bf16" \
    ZOO_EXPORT_ARGS="unit.dtype=bfloat16" bash tools/gpu_check.sh "$BUNDLE" lingbot-va-tiny fast-wam-tiny
fi
if want chunk; then
  after=(); want real && after=(--after real)
  bench_chunk=(benchmarks/bench_chunk.py --out "$WORK/chunk" --policies "$CHUNK_POLICY")
  # Quoted here: in_env hands the words to bash -c as one line ([, ], commas and spaces in an override).
  [ ${#CHUNK_SET[@]} -eq 0 ] || bench_chunk+=(--set $(printf '%q ' "${CHUNK_SET[@]}"))
  chunk() { in_env python3 "${bench_chunk[@]}" "$@"; }
  # The lowering does not wait for the runtime build: it verifies on torch's AOTI runner, and ExecuTorch's runtime
  # is then judged by the policy check through it and by the method latencies, which do wait for the build.
  "$J" start "$WORK" chunk-lower "${after[@]}" --limit 1500 -- bash -c "$(in_env unset ZOO_ET_RUNNER \&\& env \
    ZOO_LOWERING_PROFILE_DIR="$WORK/chunk/profiles" python3 -m zoo.core.sampling_profiler \
    --out "$WORK/chunk/lower-profile.txt" "${bench_chunk[@]}" --only lower)"
  et=()
  if want runtime; then
    et=(--executorch)
    "$J" start "$WORK" chunk-check --after chunk-lower,runtime --limit 900 -- bash -c "$(chunk --only check --backend executorch)"
  else
    "$J" start "$WORK" chunk-check --after chunk-lower --limit 900 -- bash -c "$(chunk --only check)"
  fi
  # LeRobot's per-block compile is left out (measured before, slower than eager for LingBot-VA), and the compiled
  # PyTorch steps come after LeRobot eager; the bench writes its JSON after every candidate, so a run cut short
  # keeps what it measured.
  "$J" start "$WORK" chunk-bench --after chunk-check --limit 1500 -- bash -c "$(chunk --only bench --cuda-graphs "${et[@]}" \
    --pytorch --no-compile --episodes 2 --chunks 3 --record) && cp zoo/data/chunk_latency.json \"$WORK/chunk/recorded_chunk_latency.json\""
  # Last: the per-method times on both runtimes were measured before; what this adds is the peak GPU memory
  # over repeated calls, which shows whether the runtime frees what each call hands back.
  dit=(video_step action_step); [ "$CHUNK_POLICY" = fast_wam ] && dit=(prefill action_step)
  want runtime && "$J" start "$WORK" chunk-methods --after chunk-bench --limit 600 -- bash -c "$(in_env python3 \
    benchmarks/gpu_runtime_check.py "$WORK/chunk/$CHUNK_POLICY/run" --no-verify --steps 0 --latency "${dit[@]}" \
    --memory --runner "$RUNNER" --out "$WORK/chunk/methods")"
fi
"$J" table "$WORK"
