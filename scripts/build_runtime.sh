#!/usr/bin/env bash
# Build ExecuTorch's C++ runtime with its CUDA backend, plus zoo's runner (runtime/cpp), from source:
#   scripts/build_runtime.sh SRC OUT_DIR [--cpu] [--jobs N]
#   scripts/build_runtime.sh --tarball FILE OUT_DIR [--cpu] [--jobs N]                 (offline)
# SRC: an ExecuTorch source tree with the submodules its root CMakeLists adds, as
#      `git clone --branch v1.2.0 --recursive https://github.com/pytorch/executorch` makes one; or a tag (v1.2.0):
#      then the script makes that clone itself, once, into OUT_DIR/src/executorch ($ZOO_EXECUTORCH_GIT: another
#      remote or a local mirror).
# --tarball FILE: an ExecuTorch source tarball (.tar.xz/.tar.gz) extracting to executorch/ with those submodules,
#      for a machine without network (docs/runtime.md: how to make one from the clone).
# OUT_DIR: gets src/ (the unpacked tarball or the clone), build/ (CMake + ninja), build.log, stamp.json, status, the
#      runner at OUT_DIR/build/zoo_runner and the in-process library at OUT_DIR/build/libzoo_session.so. The last
#      line on stderr (and in build.log) is the wall time.
# In the background: `nice -n 10 scripts/build_runtime.sh SRC OUT > OUT.console 2>&1 &`, then poll OUT/status: one
#      line, "running: ...", then "ok: built in N s wall ...; runner PATH" or "failed: exit N after N s; log ...".
# Builds only the targets zoo_runner and libzoo_session.so need (runtime core, Module/FlatTensor extensions, portable
# kernels and, with CUDA, the CUDA backend and its shim library), in Release with ExecuTorch's logging compiled in.
# A second call with the same source, flags and tools reuses OUT_DIR (configure skipped, ninja finds nothing to do).
# Patches: runtime/patches/executorch-<MAJOR.MINOR>-*.patch are applied to a source of that release (a tarball as
#   it is unpacked, a tree to a copy under OUT_DIR/src) in sorted order and named in the stamp and in `zoo_runner
#   --info`; for 1.2 one frees the output handles a .so replaces (1.2 leaks them in every call) and one backports
#   1.4's weight_sharing_across_methods (each file says why). ZOO_RUNTIME_PATCHES=none skips them.
# --cpu (or ZOO_RUNTIME_CUDA=OFF): without the CUDA backend, the portable runtime only (for a CPU machine).
# Environment: ZOO_RUNTIME_CUDA (ON/OFF, default ON), PYTHON (the Python whose torch the CUDA backend's configure
#   finds, default python3), CMAKE (default cmake), JOBS (default nproc), ZOO_CMAKE_ARGS (extra CMake arguments,
#   e.g. -DCMAKE_CUDA_ARCHITECTURES=87 on a Jetson Orin), CUDA_HOME (the toolkit; default: from the nvcc on PATH,
#   else /usr/local/cuda), TORCH_CUDA_ARCH_LIST (default: the visible GPU's, from nvidia-smi; required without one).
set -euo pipefail
# The whole script is one function, parsed before it runs: editing this file while a build runs cannot change
# what the running build does next.
main() {

usage() {
  echo "usage: scripts/build_runtime.sh SRC OUT_DIR [--cpu] [--jobs N]   (SRC: an ExecuTorch source tree, or a tag: v1.2.0)" >&2
  echo "       scripts/build_runtime.sh --tarball FILE OUT_DIR [--cpu] [--jobs N]   (offline: an ExecuTorch source tarball)" >&2
  exit 2
}
CUDA="${ZOO_RUNTIME_CUDA:-ON}"
JOBS="${JOBS:-$(nproc)}"
TARBALL=""; ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CUDA=OFF ;;
    --cuda) CUDA=ON ;;
    --jobs) [ $# -ge 2 ] || usage; JOBS="$2"; shift ;;
    --tarball) [ $# -ge 2 ] || usage; TARBALL="$2"; shift ;;
    -*) usage ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
if [ -n "$TARBALL" ]; then
  [ ${#ARGS[@]} -eq 1 ] || usage
  [ -f "$TARBALL" ] || { echo "[build_runtime] --tarball $TARBALL: no such file" >&2; exit 2; }
  SRC="$TARBALL"; OUT="${ARGS[0]}"
else
  [ ${#ARGS[@]} -eq 2 ] || usage
  SRC="${ARGS[0]}"; OUT="${ARGS[1]}"
fi
case "$CUDA" in ON|on|1|true) CUDA=ON ;; OFF|off|0|false) CUDA=OFF ;; *) echo "ZOO_RUNTIME_CUDA must be ON or OFF" >&2; exit 2 ;; esac

REPO="$(cd "$(dirname "$0")/.." && pwd)"
RUNNER_SRC="$REPO/runtime/cpp"
PATCH_DIR="$REPO/runtime/patches"
# The patches for an ExecuTorch version ("1.2.0a0" -> executorch-1.2-*.patch), one path per line, sorted.
patches_for() {
  local release; release="$(echo "$1" | grep -o '^[0-9]*\.[0-9]*')"
  [ "${ZOO_RUNTIME_PATCHES:-}" = none ] && return 0
  ls "$PATCH_DIR"/executorch-"$release"-*.patch 2>/dev/null | LC_ALL=C sort || true
}
# Applies the patches to the tree $1 (checked first, so a patch that does not apply changes nothing).
apply_patches() {
  local tree="$1"; shift
  local p
  for p in "$@"; do
    patch -p1 -d "$tree" --dry-run -s < "$p" >/dev/null || { echo "[build_runtime] $p does not apply to $tree" >&2; return 1; }
    patch -p1 -d "$tree" -s < "$p"
    echo "[build_runtime] applied $(basename "$p")" >&2
  done
}
PY="${PYTHON:-python3}"
CMAKE="${CMAKE:-cmake}"
command -v "$PY" >/dev/null || { echo "[build_runtime] no $PY: set PYTHON to a Python with torch installed" >&2; exit 2; }
PY="$(command -v "$PY")"
command -v "$CMAKE" >/dev/null || { echo "[build_runtime] no cmake (3.29+ for the CUDA backend)" >&2; exit 2; }
command -v ninja >/dev/null || { echo "[build_runtime] no ninja on PATH" >&2; exit 2; }
if [ "$CUDA" = ON ] && ! command -v nvcc >/dev/null; then
  echo "[build_runtime] the CUDA backend needs nvcc on PATH (CUDA toolkit); for the portable runtime only, pass --cpu" >&2
  exit 2
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
LOG="$OUT/build.log"
STAMP="$OUT/stamp.json"
BUILD="$OUT/build"
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
start_all=$(date +%s.%N)
# OUT_DIR/status, for whoever started this in the background: "running ...", then "ok ..." or "failed ...".
STATUS="$OUT/status"
echo "running: pid $$ since $(date -u +%FT%TZ); log $LOG" > "$STATUS"
trap 'rc=$?; [ $rc -eq 0 ] || echo "failed: exit $rc after $(elapsed "$start_all") s; log $LOG" > "$STATUS"' EXIT

# --- the source tree -------------------------------------------------------------------------------------------------
# PATCH_HASH: the patches' names and contents, part of the source's identity (a changed patch unpacks again).
patch_hash() { [ $# -eq 0 ] && echo none || cat "$@" | sha256sum | cut -d' ' -f1; }
if [ -f "$SRC" ]; then
  SRC_HASH="sha256:$(sha256sum "$SRC" | cut -d' ' -f1)"
  ET_DIR="$OUT/src/executorch"
  version="$(tar -xOf "$SRC" executorch/version.txt 2>/dev/null | tr -d '[:space:]' || true)"
  mapfile -t PATCHES < <(patches_for "$version")
  SRC_HASH="$SRC_HASH patches:$(patch_hash "${PATCHES[@]}")"
  if [ "$(cat "$OUT/src/.source-hash" 2>/dev/null || true)" != "$SRC_HASH" ]; then
    echo "[build_runtime] unpacking $SRC" >&2
    rm -rf "$OUT/src" "$OUT/src.tmp" "$BUILD"
    mkdir -p "$OUT/src.tmp"
    tar -xf "$SRC" -C "$OUT/src.tmp"
    [ -f "$OUT/src.tmp/executorch/CMakeLists.txt" ] || { echo "[build_runtime] $SRC does not extract to executorch/" >&2; rm -rf "$OUT/src.tmp"; exit 2; }
    apply_patches "$OUT/src.tmp/executorch" "${PATCHES[@]}" || { rm -rf "$OUT/src.tmp"; exit 2; }
    echo "$SRC_HASH" > "$OUT/src.tmp/.source-hash"
    mv "$OUT/src.tmp" "$OUT/src"
  fi
elif [ -f "$SRC/CMakeLists.txt" ] && [ -f "$SRC/version.txt" ]; then
  SRC="$(cd "$SRC" && pwd)"
  # Content of every file but .git: a tree changed in place is rebuilt from scratch.
  SRC_HASH="tree-sha256:$(cd "$SRC" && find . -path ./.git -prune -o -type f -print0 | LC_ALL=C sort -z \
    | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
  mapfile -t PATCHES < <(patches_for "$(tr -d '[:space:]' < "$SRC/version.txt")")
  if [ ${#PATCHES[@]} -gt 0 ]; then
    # Patched in a copy: the tree given is never changed.
    SRC_HASH="$SRC_HASH patches:$(patch_hash "${PATCHES[@]}")"
    ET_DIR="$OUT/src/executorch"
    if [ "$(cat "$OUT/src/.source-hash" 2>/dev/null || true)" != "$SRC_HASH" ]; then
      echo "[build_runtime] copying $SRC to patch it" >&2
      rm -rf "$OUT/src" "$OUT/src.tmp" "$BUILD"
      mkdir -p "$OUT/src.tmp/executorch"
      (cd "$SRC" && tar -cf - --exclude=./.git .) | tar -xf - -C "$OUT/src.tmp/executorch"
      apply_patches "$OUT/src.tmp/executorch" "${PATCHES[@]}" || { rm -rf "$OUT/src.tmp"; exit 2; }
      echo "$SRC_HASH" > "$OUT/src.tmp/.source-hash"
      mv "$OUT/src.tmp" "$OUT/src"
    fi
  # ExecuTorch's sources include each other as <executorch/...>: the tree must be reachable under that name.
  elif [ "$(basename "$SRC")" = executorch ]; then
    ET_DIR="$SRC"
  else
    mkdir -p "$OUT/src"; ln -sfn "$SRC" "$OUT/src/executorch"; ET_DIR="$OUT/src/executorch"
  fi
elif [ ! -e "$SRC" ] && [[ "$SRC" =~ ^(v[0-9][0-9A-Za-z.+-]*|main|release/[0-9][0-9.]*)$ ]]; then
  # A tag or branch: the clone a user makes, once per remote and ref, into OUT_DIR/src/executorch.
  GIT_URL="${ZOO_EXECUTORCH_GIT:-https://github.com/pytorch/executorch}"
  ET_DIR="$OUT/src/executorch"
  if [ "$(cat "$OUT/src/.source-ref" 2>/dev/null || true)" != "$GIT_URL $SRC" ] || [ ! -f "$ET_DIR/version.txt" ]; then
    command -v git >/dev/null || { echo "[build_runtime] cloning $SRC needs git; or pass a source tree or --tarball FILE" >&2; exit 2; }
    echo "[build_runtime] git clone --branch $SRC --recursive $GIT_URL (once for this OUT_DIR)" >&2
    rm -rf "$OUT/src" "$OUT/src.tmp" "$BUILD"
    mkdir -p "$OUT/src.tmp"
    if ! git clone --quiet --branch "$SRC" --recursive "$GIT_URL" "$OUT/src.tmp/executorch" >&2; then
      rm -rf "$OUT/src.tmp"
      echo "[build_runtime] git clone of $SRC from $GIT_URL failed (no network? clone elsewhere and pass the tree, or --tarball FILE)" >&2
      exit 2
    fi
    echo "$GIT_URL $SRC" > "$OUT/src.tmp/.source-ref"
    mv "$OUT/src.tmp" "$OUT/src"
  fi
  # The commit and every submodule's: a clone moved to another commit is rebuilt from scratch.
  SRC_HASH="git:$( (git -C "$ET_DIR" rev-parse HEAD; git -C "$ET_DIR" submodule status --recursive) | sha256sum | cut -d' ' -f1)"
else
  echo "[build_runtime] $SRC is neither an ExecuTorch source tree (CMakeLists.txt + version.txt), a tag (v1.2.0)" \
       "nor a source tarball (--tarball FILE)" >&2
  exit 2
fi
ET_VERSION="$(tr -d '[:space:]' < "$ET_DIR/version.txt")"

# --- what the build depends on: the stamp ------------------------------------------------------------------------------
CMAKE_VERSION="$("$CMAKE" --version | head -1 | awk '{print $3}')"
CXX_VERSION="$( (${CXX:-c++} --version 2>/dev/null || true) | head -1)"
NVCC_VERSION="none"
CUDA_ROOT=""
if [ "$CUDA" = ON ]; then
  # One toolkit for everything: CMake's CUDA language, FindCUDAToolkit, and the legacy FindCUDA that torch's CMake
  # config still calls (which derives the root from the nvcc on PATH and fails when that nvcc is a wrapper script).
  CUDA_ROOT="${CUDA_HOME:-${CUDA_PATH:-}}"
  if [ -z "$CUDA_ROOT" ]; then
    for cand in "$(dirname "$(command -v nvcc)")/.." /usr/local/cuda; do
      if [ -f "$cand/include/cuda_runtime.h" ] && [ -x "$cand/bin/nvcc" ]; then CUDA_ROOT="$(cd "$cand" && pwd)"; break; fi
    done
  fi
  if [ -z "$CUDA_ROOT" ] || [ ! -x "$CUDA_ROOT/bin/nvcc" ] || [ ! -f "$CUDA_ROOT/include/cuda_runtime.h" ]; then
    echo "[build_runtime] cannot find the CUDA toolkit (bin/nvcc and include/cuda_runtime.h); set CUDA_HOME" >&2
    exit 2
  fi
  NVCC_VERSION="$("$CUDA_ROOT/bin/nvcc" --version | grep -o 'release [0-9.]*, V[0-9.]*' | head -1)"
  # torch's CMake config adds -gencode flags for TORCH_CUDA_ARCH_LIST to every CUDA compile (the backend's one .cu);
  # left to guess without a GPU it lists compute_50, which CUDA 13's nvcc refuses, and the build fails late.
  if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ' || true)"
    if [ -z "$TORCH_CUDA_ARCH_LIST" ]; then
      echo "[build_runtime] no GPU visible to read the architecture from: set TORCH_CUDA_ARCH_LIST (9.0 for H100/H200," \
           "8.0 for A100, 8.7 for Jetson Orin)" >&2
      exit 2
    fi
  fi
  export TORCH_CUDA_ARCH_LIST
fi
TORCH_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || echo none)"
if [ "$CUDA" = ON ] && [ "$TORCH_VERSION" = none ]; then
  echo "[build_runtime] $PY cannot import torch; ExecuTorch's CUDA backend configure needs it (set PYTHON)" >&2
  exit 2
fi
PATCH_NAMES="$(for p in "${PATCHES[@]}"; do basename "$p" .patch; done | paste -sd, -)"
CMAKE_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release "-DEXECUTORCH_SOURCE_DIR=$ET_DIR" "-DZOO_RUNTIME_CUDA=$CUDA"
             "-DPYTHON_EXECUTABLE=$PY" "-DZOO_RUNTIME_PATCHES=$PATCH_NAMES")
[ -n "$CUDA_ROOT" ] && CMAKE_FLAGS+=("-DCUDAToolkit_ROOT=$CUDA_ROOT" "-DCUDA_TOOLKIT_ROOT_DIR=$CUDA_ROOT"
                                     "-DCMAKE_CUDA_COMPILER=$CUDA_ROOT/bin/nvcc")
# shellcheck disable=SC2206
[ -n "${ZOO_CMAKE_ARGS:-}" ] && CMAKE_FLAGS+=(${ZOO_CMAKE_ARGS})
# What CMake does not track itself. (A changed runtime/cpp source or CMakeLists is rebuilt by ninja, which re-runs
# CMake when a CMakeLists changes.)
KEY="$(printf '%s\n' "$SRC_HASH" "$CUDA" "${CMAKE_FLAGS[*]}" "$CMAKE_VERSION" "$CXX_VERSION" "$NVCC_VERSION" \
       "$TORCH_VERSION" "${TORCH_CUDA_ARCH_LIST:-}" "$RUNNER_SRC" | sha256sum | cut -d' ' -f1)"

reused=false
if [ -f "$STAMP" ] && [ -x "$BUILD/zoo_runner" ] && [ -f "$BUILD/libzoo_session.so" ] \
   && "$PY" -c 'import json,sys; sys.exit(json.load(open(sys.argv[1])).get("key") != sys.argv[2])' "$STAMP" "$KEY"; then
  reused=true
fi

export MAKEFLAGS="-j$JOBS"  # flatc and flatcc build as ExternalProjects with make: let them use the cores too
configure_s=0
if [ "$reused" = false ]; then
  rm -rf "$BUILD" "$STAMP"
  echo "[build_runtime] configuring (CUDA $CUDA, ExecuTorch $ET_VERSION, log: $LOG)" >&2
  t0=$(date +%s.%N)
  if ! "$CMAKE" -S "$RUNNER_SRC" -B "$BUILD" "${CMAKE_FLAGS[@]}" > "$LOG" 2>&1; then
    tail -40 "$LOG" >&2; echo "[build_runtime] configure FAILED; full log: $LOG" >&2; exit 1
  fi
  configure_s=$(elapsed "$t0")
else
  echo "[build_runtime] reusing $BUILD (stamp matches)" >&2
  : >> "$LOG"
fi

echo "[build_runtime] building zoo_runner and libzoo_session.so with $JOBS jobs" >&2
t0=$(date +%s.%N)
if ! "$CMAKE" --build "$BUILD" --target zoo_runner zoo_session -j "$JOBS" >> "$LOG" 2>&1; then
  tail -60 "$LOG" >&2; echo "[build_runtime] build FAILED; full log: $LOG" >&2; exit 1
fi
build_s=$(elapsed "$t0")
total_s=$(elapsed "$start_all")
steps="$(grep -c '^\[[0-9]*/[0-9]*\]' "$LOG" || true)"

INFO="$("$BUILD/zoo_runner" --info 2>>"$LOG" | tail -1)" || { echo "[build_runtime] the built zoo_runner does not start: $INFO" >&2; exit 1; }
if [ "$CUDA" = ON ] && ! grep -q '"CudaBackend"' <<<"$INFO"; then
  echo "[build_runtime] zoo_runner was built with CUDA but CudaBackend is not registered: $INFO" >&2; exit 1
fi

if [ "$reused" = false ]; then
  KEY="$KEY" SRC="$SRC" SRC_HASH="$SRC_HASH" ET_VERSION="$ET_VERSION" CUDA="$CUDA" FLAGS="${CMAKE_FLAGS[*]}" \
  JOBS="$JOBS" CMAKE_VERSION="$CMAKE_VERSION" CXX_VERSION="$CXX_VERSION" NVCC_VERSION="$NVCC_VERSION" \
  TORCH_VERSION="$TORCH_VERSION" ARCHS="${TORCH_CUDA_ARCH_LIST:-}" CONFIGURE_S="$configure_s" BUILD_S="$build_s" TOTAL_S="$total_s" \
  STEPS="${steps:-0}" RUNNER="$BUILD/zoo_runner" INFO="$INFO" PATCH_NAMES="$PATCH_NAMES" "$PY" - "$STAMP" <<'EOF'
import json, os, sys
e = os.environ
stamp = {"key": e["KEY"], "source": e["SRC"], "source_hash": e["SRC_HASH"], "executorch_version": e["ET_VERSION"],
         "cuda": e["CUDA"] == "ON", "cmake_flags": e["FLAGS"].split(" "), "jobs": int(e["JOBS"]),
         "cmake": e["CMAKE_VERSION"], "cxx": e["CXX_VERSION"], "nvcc": e["NVCC_VERSION"], "torch": e["TORCH_VERSION"],
         "torch_cuda_arch_list": e["ARCHS"], "patches": [p for p in e["PATCH_NAMES"].split(",") if p],
         "configure_seconds": float(e["CONFIGURE_S"]), "build_seconds": float(e["BUILD_S"]),
         "seconds": float(e["TOTAL_S"]), "ninja_steps": int(e["STEPS"]), "runner": e["RUNNER"],
         "runner_info": json.loads(e["INFO"])}
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(stamp, f, indent=1)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
EOF
fi
done_line="$(printf '%s in %.1f s wall (configure %.1f s, build %.1f s, %s ninja steps, %s jobs); log %s' \
  "$([ "$reused" = true ] && echo reused || echo built)" "$total_s" "$configure_s" "$build_s" "${steps:-0}" "$JOBS" "$LOG")"
echo "[build_runtime] $done_line" >&2
echo "[build_runtime] $done_line" >> "$LOG"
echo "ok: $done_line; runner $BUILD/zoo_runner" > "$STATUS"
echo "$BUILD/zoo_runner"
}

main "$@"; exit $?  # on one line: bash has read the exit before main runs
