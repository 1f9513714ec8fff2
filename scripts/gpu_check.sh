#!/usr/bin/env bash
# Check an offline GPU box with a bundle made by `python -m zoo bundle`:
#   scripts/gpu_check.sh BUNDLE_DIR [--et-runner PATH] [RECIPE ...]        (default: the three tiny recipes)
# Installs the bundle's wheels into a folder (no network, no venv needed: the box's own torch is used),
# points executorch at its flatc and huggingface_hub at the bundle's Hub cache, prints the environment, runs
# each recipe end to end, and ends with one table: per recipe, each stage, its time, the verification result.
# --et-runner PATH (or $ZOO_ET_RUNNER): a zoo_runner built by scripts/build_runtime.sh. Every recipe is then
# verified on both runtimes (torch's AOTI runner and ExecuTorch's C++ runtime: --runtime both), the default list
# adds the float32-pair variants of the tiny LingBot-VA and Fast-WAM recipes (RECIPE+f32pairs: rotary_pairs=float32
# and narrow_float64 in place of split_float64_constants, the variant ExecuTorch 1.2's runtime can load; as written they use float64 pairs, which it cannot), and
# scripts/gpu_runtime_check.py ends with one short table (recipe, method, runtime, seed/sizes, worst rel L2,
# cosine, pass) plus LingBot-VA's 3-call KV pool sequence through the C++ runner against eager (the pool held on the
# GPU), the GPU memory of every method loaded with weights shared and not, and zoo's policy check with the runner on
# backend=executorch against LeRobot; its text and JSON
# go to $ZOO_CHECK_OUT (default: $OUT when set, else RUNS/runtime-check).
# Environment: ZOO_SITE (install folder, default /tmp/zoo-site), ZOO_RUNS (run folders, default ./runs),
# ZOO_PYTHON (default python3), ZOO_EXPORT_ARGS (extra overrides for every recipe).
set -uo pipefail
if [ $# -lt 1 ] || [ ! -d "$1/wheels" ]; then
  echo "usage: scripts/gpu_check.sh BUNDLE_DIR [RECIPE ...]  (BUNDLE_DIR made by: python -m zoo bundle BUNDLE_DIR)" >&2
  exit 2
fi
BUNDLE="$(cd "$1" && pwd)"; shift
ET_RUNNER="${ZOO_ET_RUNNER:-}"
if [ "${1:-}" = --et-runner ]; then
  [ $# -ge 2 ] || { echo "[gpu_check] --et-runner takes the zoo_runner path" >&2; exit 2; }
  ET_RUNNER="$2"; shift 2
fi
RECIPES=("$@")
if [ ${#RECIPES[@]} -eq 0 ]; then
  RECIPES=(llama-rope-tiny lingbot-va-tiny fast-wam-tiny)
  [ -z "$ET_RUNNER" ] || RECIPES+=(lingbot-va-tiny+f32pairs fast-wam-tiny+f32pairs)
fi
if [ -n "$ET_RUNNER" ]; then
  [ -x "$ET_RUNNER" ] || { echo "[gpu_check] $ET_RUNNER is not an executable zoo_runner (scripts/build_runtime.sh)" >&2; exit 2; }
  ET_RUNNER="$(cd "$(dirname "$ET_RUNNER")" && pwd)/$(basename "$ET_RUNNER")"
fi
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${ZOO_PYTHON:-python3}"
SITE="${ZOO_SITE:-/tmp/zoo-site}"
RUNS="${ZOO_RUNS:-$REPO/runs}"

echo "[gpu_check] installing $(ls "$BUNDLE"/wheels/*.whl | wc -l) wheels from $BUNDLE into $SITE (offline)" >&2
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "$BUNDLE"/wheels/*.whl || { echo "[gpu_check] offline install failed" >&2; exit 2; }
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
FLATC="$SITE/executorch/data/bin/flatc"
if [ -f "$FLATC" ]; then chmod +x "$FLATC"; export FLATC_EXECUTABLE="$FLATC"; fi
export HF_HUB_CACHE="$BUNDLE/hub" ZOO_TINY_HUB_CACHE="$BUNDLE/hub" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

cd "$REPO"
"$PY" -m zoo doctor || exit 2
mkdir -p "$RUNS"
runtime_args=()
[ -z "$ET_RUNNER" ] || runtime_args=(--runtime both --et-runner "$ET_RUNNER")
for entry in "${RECIPES[@]}"; do
  # RECIPE+f32pairs: the recipe with float32 rotary pairs, in its own run folder
  recipe="${entry%%+*}"; variant=()
  case "$entry" in
    *+f32pairs)
      # float32 rotary pairs, and every other float64 value narrowed (narrow_float64 in place of
      # split_float64_constants): the artifact then needs no float64 tensor, which ExecuTorch 1.2's runtime lacks
      mapfile -t variant < <("$PY" -c 'import sys
from zoo.recipes import load_recipe
rewrites = [("narrow_float64" if r == "split_float64_constants" else r) for r in load_recipe(sys.argv[1]).rewrites]
rewrites += [] if "narrow_float64" in rewrites else ["narrow_float64"]
print("rotary_pairs=float32")
print("rewrites=[" + ",".join(rewrites) + "]")' "$recipe")
      [ ${#variant[@]} -eq 2 ] || { echo "[gpu_check] cannot make the float32-pair variant of $recipe" >&2; exit 2; } ;;
    *+*) echo "[gpu_check] unknown variant in $entry (known: RECIPE+f32pairs)" >&2; exit 2 ;;
  esac
  echo "[gpu_check] ===== $entry =====" >&2
  # shellcheck disable=SC2086
  "$PY" -m zoo.export "$recipe" "${variant[@]}" ${ZOO_EXPORT_ARGS:-} --output-dir "$RUNS/$entry" "${runtime_args[@]}" \
    2>&1 | tee "$RUNS/$entry.log"
done
args=()
for entry in "${RECIPES[@]}"; do args+=("$RUNS/$entry"); done
"$PY" -m zoo doctor --require-verified "${args[@]}"
rc=$?
if [ -n "$ET_RUNNER" ]; then
  echo "[gpu_check] ===== both runtimes, side by side (from each run's report.json), and the KV pool sequence =====" >&2
  CHECK_OUT="${ZOO_CHECK_OUT:-${OUT:-$RUNS}/runtime-check}"
  "$PY" scripts/gpu_runtime_check.py "${args[@]}" --from-report --steps 3 --memory --policy-check --runner "$ET_RUNNER" \
    --out "$CHECK_OUT" \
    || rc=1
  echo "[gpu_check] runtime check: $CHECK_OUT/runtime_check.txt and runtime_check.json" >&2
fi
exit $rc
