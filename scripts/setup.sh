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
     "lerobot 0.6.1 ... (log: $VENV/install.log)" >&2
if ! "$VENV/bin/python" -m pip install -e ".[policies,test]" >"$VENV/install.log" 2>&1; then
  tail -30 "$VENV/install.log" >&2
  echo "[zoo setup] install failed; the full log is $VENV/install.log" >&2
  exit 2
fi
echo "$WANT" >"$STAMP"
echo "[zoo setup] ready: $VENV" >&2
