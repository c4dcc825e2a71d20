#!/usr/bin/env bash
# Installs loraplex into the current Python environment; `--test` adds the test extras.
# Without a GPU the CPU build of torch (and the Triton release whose CPU interpreter the kernel tests
# use) is pinned first, since a plain `torch` requirement pulls a multi-GB CUDA build; with a GPU the
# installed torch and triton are kept as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test]"; fi
if ! nvidia-smi -L >/dev/null 2>&1; then
  python3 -m pip install -q torch==2.13.0 triton==3.7.1
fi
python3 -m pip install -q -e ".${extras}"
