#!/usr/bin/env bash
# Check an offline GPU box with a bundle made by `python -m zoo bundle`:
#   scripts/gpu_check.sh BUNDLE_DIR [RECIPE ...]        (default: the three tiny recipes)
# Installs the bundle's wheels into a folder (no network, no venv needed: the box's own torch is used),
# points executorch at its flatc and huggingface_hub at the bundle's Hub cache, prints the environment, runs
# each recipe end to end, and ends with one table: per recipe, each stage, its time, the verification result.
# Environment: ZOO_SITE (install folder, default /tmp/zoo-site), ZOO_RUNS (run folders, default ./runs),
# ZOO_PYTHON (default python3), ZOO_EXPORT_ARGS (extra overrides for every recipe).
set -uo pipefail
if [ $# -lt 1 ] || [ ! -d "$1/wheels" ]; then
  echo "usage: scripts/gpu_check.sh BUNDLE_DIR [RECIPE ...]  (BUNDLE_DIR made by: python -m zoo bundle BUNDLE_DIR)" >&2
  exit 2
fi
BUNDLE="$(cd "$1" && pwd)"; shift
RECIPES=("$@"); [ ${#RECIPES[@]} -gt 0 ] || RECIPES=(llama-rope-tiny lingbot-va-tiny fast-wam-tiny)
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
for recipe in "${RECIPES[@]}"; do
  echo "[gpu_check] ===== $recipe =====" >&2
  # shellcheck disable=SC2086
  "$PY" -m zoo.export "$recipe" ${ZOO_EXPORT_ARGS:-} --output-dir "$RUNS/$recipe" 2>&1 | tee "$RUNS/$recipe.log"
done
args=()
for recipe in "${RECIPES[@]}"; do args+=("$RUNS/$recipe"); done
"$PY" -m zoo doctor --require-verified "${args[@]}"
