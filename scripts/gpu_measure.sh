#!/usr/bin/env bash
# Everything the docs report from a GPU, in one call on an offline GPU box, jobs side by side:
#   scripts/gpu_measure.sh BUNDLE_DIR OUT_DIR [--check RECIPE ...] [--bench RUN_RECIPE OVERRIDE ...] [--tests] [--real ARG ...]...
#
#   --check   scripts/gpu_check.sh BUNDLE_DIR RECIPE ... : the offline install and the tiny recipes end to end
#   --bench   python -m zoo.export RUN_RECIPE OVERRIDE ... then `python -m zoo bench RUN --rotary` on that run
#   --tests   pytest -m gpu tests (every GPU-marked test)
#   --real    scripts/bench_real_size.py ARG ... (e.g. --units fast_wam --profile); each --real is a job of its
#             own, so several real-size units lower side by side (ARGs without spaces)
#
# Each job has its own log and a time limit (ZOO_JOB_TIMEOUT seconds, default 540), so a slow job keeps what
# the others measured. OUT_DIR ends with summary.txt (every table, printed last too), the bench and real-size
# JSON/Markdown, and logs.tar.gz (each job's log, run reports and JSON, no artifacts).
set -uo pipefail
if [ $# -lt 2 ] || [ ! -d "$1/wheels" ]; then
  echo "usage: scripts/gpu_measure.sh BUNDLE_DIR OUT_DIR [--check RECIPE ...] [--bench RECIPE OVERRIDE ...] [--tests] [--real ARG ...]..." >&2
  exit 2
fi
BUNDLE="$(cd "$1" && pwd)"; OUT="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2
CHECK=(); BENCH=(); REAL=(); TESTS=0; part=""
for arg in "$@"; do
  case "$arg" in
    --check|--bench) part="$arg" ;;
    --tests) TESTS=1; part="" ;;
    --real) part="$arg"; REAL+=("") ;;
    *) case "$part" in
         --check) CHECK+=("$arg") ;; --bench) BENCH+=("$arg") ;;
         --real) REAL[${#REAL[@]}-1]="${REAL[${#REAL[@]}-1]} $arg" ;;
         *) echo "gpu_measure: '$arg' comes before --check/--bench/--real" >&2; exit 2 ;;
       esac ;;
  esac
done
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${ZOO_PYTHON:-python3}"
LIMIT="${ZOO_JOB_TIMEOUT:-540}"
WORK="${ZOO_WORK:-/tmp/zoo-measure}"
SITE="$WORK/site"
rm -rf "$WORK"; mkdir -p "$WORK/logs"
cd "$REPO"

# gpu_check.sh installs the bundle into a folder of its own; the other jobs share this one.
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$BUNDLE"/wheels/*.whl \
  || { echo "gpu_measure: offline install failed" >&2; exit 2; }
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" FLATC_EXECUTABLE="$SITE/executorch/data/bin/flatc"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 ZOO_TINY_HUB_CACHE="$WORK/tiny-hub"
chmod +x "$FLATC_EXECUTABLE"

pids=()
if [ ${#CHECK[@]} -gt 0 ]; then
  ( ZOO_SITE="$WORK/check-site" ZOO_RUNS="$WORK/check" PYTHONPATH="" timeout "$LIMIT" \
      bash scripts/gpu_check.sh "$BUNDLE" "${CHECK[@]}" > "$WORK/logs/check.log" 2>&1
    echo "gpu_check exit $?" >> "$WORK/logs/check.log" ) &
  pids+=($!)
fi
if [ ${#BENCH[@]} -gt 0 ]; then
  ( run="$WORK/bench-run"
    timeout "$LIMIT" "$PY" -m zoo.export "${BENCH[@]}" --output-dir "$run" > "$WORK/logs/bench.log" 2>&1
    echo "export exit $?" >> "$WORK/logs/bench.log"
    "$PY" -m zoo audit "$run" >> "$WORK/logs/bench.log" 2>&1
    timeout "$LIMIT" "$PY" -m zoo bench "$run" --rotary --json "$OUT/bench.json" --markdown "$OUT/bench.md" \
      >> "$WORK/logs/bench.log" 2>&1
    echo "bench exit $?" >> "$WORK/logs/bench.log" ) &
  pids+=($!)
fi
if [ "$TESTS" = 1 ]; then
  ( timeout "$LIMIT" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rA tests > "$WORK/logs/tests.log" 2>&1
    echo "pytest -m gpu exit $?" >> "$WORK/logs/tests.log" ) &
  pids+=($!)
fi
for i in "${!REAL[@]}"; do
  # shellcheck disable=SC2086
  ( timeout "$LIMIT" "$PY" scripts/bench_real_size.py --out "$WORK/real$i" ${REAL[$i]} > "$WORK/logs/real$i.log" 2>&1
    echo "bench_real_size exit $?" >> "$WORK/logs/real$i.log"
    cp "$WORK/real$i/bench.json" "$OUT/real$i.bench.json" 2>/dev/null
    cp "$WORK/real$i/bench.md" "$OUT/real$i.bench.md" 2>/dev/null ) &
  pids+=($!)
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$WORK/logs/gpu.txt" 2>&1
wait "${pids[@]}"

# Reports and JSON travel; artifacts (.pte/.ptd/.so/.pt2) do not.
(cd "$WORK" && find . -path ./site -prune -o -path ./check-site -prune -o -path ./tiny-hub -prune -o -type f \
   \( -name '*.log' -o -name '*.md' -o -name '*.json' -o -name '*.txt' \) -print \
   | tar czf "$OUT/logs.tar.gz" -T -)
{
  echo "== GPU"; cat "$WORK/logs/gpu.txt"
  for log in "$WORK"/logs/*.log; do
    echo; echo "== $(basename "$log" .log) (last lines of its log)"; tail -n 40 "$log"
  done
  for md in "$OUT"/*.md; do [ -f "$md" ] && { echo; echo "== $(basename "$md")"; cat "$md"; }; done
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
