#!/usr/bin/env bash
# Create .venv with Python 3.12 and install zoo with its policies and test extras.
# Idempotent: a venv whose stamp matches pyproject.toml is left as it is. Used by both README commands.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ZOO_VENV:-.venv}"
STAMP="$VENV/.zoo-installed"
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

find_python312() {
  for cand in python3.12 "${PYTHON:-}"; do
    if [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 \
       && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -1 || true)"
    if [ -n "$v" ] && [ -x "$(pyenv root)/versions/$v/bin/python3" ]; then
      echo "$(pyenv root)/versions/$v/bin/python3"; return 0
    fi
  fi
  if command -v python3 >/dev/null 2>&1 \
     && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    command -v python3; return 0
  fi
  return 1
}

PY="$(find_python312)" || {
  echo "[zoo setup] no Python 3.12 found (lerobot 0.6.1 needs it). Install one (e.g. 'pyenv install 3.12')" \
       "or set PYTHON=/path/to/python3.12, then run this again." >&2
  exit 2
}
echo "[zoo setup] creating $VENV with $PY ($("$PY" --version 2>&1))" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
echo "[zoo setup] installing zoo[policies,test]: torch 2.11 (a CUDA build, about 3 GB), executorch 1.2.0," \
     "lerobot 0.6.1 ... (pip's progress below; also in $VENV/install.log)" >&2
# pip's own output (a progress bar per download on a terminal, one line per file in a log) goes to the
# terminal and to install.log; pipefail makes pip's exit status the pipeline's.
# editable_mode=compat puts the checkout itself on sys.path: with the default import hook, a folder named zoo
# in the current directory (the clone itself, seen from the folder that holds it) shadows the package as an
# empty namespace package ("cannot import name ... (unknown location)").
if ! "$VENV/bin/python" -m pip install --progress-bar on --config-settings editable_mode=compat -e ".[policies,test]" \
     2>&1 | tee "$VENV/install.log" >&2; then
  echo "[zoo setup] install failed (the last lines above say why); the full log is $VENV/install.log" >&2
  exit 2
fi
echo "$WANT" >"$STAMP"
echo "[zoo setup] ready: $VENV" >&2
