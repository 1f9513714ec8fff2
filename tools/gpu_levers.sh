#!/usr/bin/env bash
# Levers measured side by side on one GPU box: the baseline and each lever lowered at once, then timed and
# policy-checked one after the other, alone on the GPU, and put in one table (benchmarks/lever_table.py):
#
#   tools/gpu_levers.sh WORK POLICY [--layers N] [--no-pytorch] [--set OVERRIDE ...] --lever NAME=OVERRIDE ...
#
# WORK: a folder tools/gpu_background.sh set up (WORK/env.sh; its runtime job builds zoo_runner, which the
# executorch candidate and the policy check use). POLICY: lingbot_va or fast_wam. --layers: the real width at N
# blocks (bench_chunk.py --layers), so that several lowerings take less time than one at full depth. --set: an override every
# variant takes. --lever: a named variant's override; a name given twice takes both.
# Each variant's bench_chunk output goes to WORK/levers/NAME, the table to WORK/levers/levers.md. Only the
# baseline times the strong PyTorch candidate (it compiles each variant's own programs, so it would carry the
# lever too); --no-pytorch leaves it out (its compile is the longest part of a bench). Nothing here waits for the jobs: tools/gpu_jobs.sh wait WORK SECONDS levers-table.
set -uo pipefail
usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 2 ] || usage
WORK="$(cd "$1" && pwd)"; POLICY="$2"; shift 2
[ -f "$WORK/env.sh" ] || { echo "gpu_levers: $WORK/env.sh is missing: run tools/gpu_background.sh first" >&2; exit 2; }
COMMON=(); NAMES=(base); declare -A LEVER; LAYERS=""; PYTORCH=" --pytorch"
while [ $# -gt 0 ]; do
  case "$1" in
    --set) COMMON+=("$2"); shift 2 ;;
    --layers) LAYERS=" --layers $2"; shift 2 ;;
    --no-pytorch) PYTORCH=""; shift ;;
    --lever)
      name="${2%%=*}"; override="${2#*=}"
      [ -n "$name" ] && [ "$name" != "$2" ] && [ "$name" != base ] || {
        echo "gpu_levers: --lever takes NAME=OVERRIDE with a NAME other than base, not '$2'" >&2; exit 2; }
      [ -n "${LEVER[$name]+x}" ] || NAMES+=("$name")
      LEVER[$name]="${LEVER[$name]:-}$(printf '%q ' "$override")"; shift 2 ;;
    *) echo "gpu_levers: unknown option $1" >&2; usage ;;
  esac
done
[ ${#NAMES[@]} -ge 2 ] || { echo "gpu_levers: give at least one --lever" >&2; exit 2; }
REPO="$(cd "$(dirname "$0")/.." && pwd)"
J="$REPO/tools/gpu_jobs.sh"
common="$( [ ${#COMMON[@]} -eq 0 ] || printf '%q ' "${COMMON[@]}")"
bench() {  # VARIANT ARGS... -> the bench_chunk command line for that variant
  local v="$1"; shift
  local sets="$common${LEVER[$v]:-}"
  echo "source $WORK/env.sh && cd $REPO && python3 benchmarks/bench_chunk.py --out $WORK/levers/$v --policies $POLICY$LAYERS" \
       "${sets:+--set $sets}$*"
}
lowers=()
for v in "${NAMES[@]}"; do
  # Side by side: zoo's admission ledger starts each worker when its memory fits (docs/ARCHITECTURE.md).
  "$J" start "$WORK" "levers-lower-$v" --limit 1500 -- bash -c "$(bench "$v" --only lower)"
  lowers+=("levers-lower-$v")
done
previous="$(IFS=,; echo "${lowers[*]}"),runtime"
[ -d "$WORK/jobs/runtime" ] || previous="$(IFS=,; echo "${lowers[*]}")"
for v in "${NAMES[@]}"; do
  extra=""; [ "$v" = base ] && extra="$PYTORCH"
  "$J" start "$WORK" "levers-bench-$v" --after "$previous" --limit 900 -- bash -c \
    "$(bench "$v" --only bench --executorch --no-compile --episodes 1 --chunks 3)$extra"
  "$J" start "$WORK" "levers-check-$v" --after "levers-bench-$v" --limit 600 -- bash -c \
    "$(bench "$v" --only check --backend executorch)"
  previous="levers-check-$v"
done
pairs=(); for v in "${NAMES[@]}"; do pairs+=("$v=$WORK/levers/$v"); done
"$J" start "$WORK" levers-table --after "$previous" --limit 120 -- bash -c \
  "source $WORK/env.sh && cd $REPO && python3 benchmarks/lever_table.py --out $WORK/levers ${pairs[*]}"
"$J" table "$WORK"
