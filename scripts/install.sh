#!/usr/bin/env bash
# Installs loraplex into the current Python environment; `--test` adds the test extras.
# Without a GPU the CPU build of torch is pinned first (a plain `torch` requirement would pull a
# multi-GB CUDA build); with one, an installed torch is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test]"; fi
if ! python3 -c "import torch" >/dev/null 2>&1; then
  if nvidia-smi -L >/dev/null 2>&1; then
    python3 -m pip install -q torch
  else
    python3 -m pip install -q torch==2.13.0
  fi
fi
python3 -m pip install -q -e ".${extras}"
