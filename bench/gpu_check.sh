#!/usr/bin/env bash
# The GPU check on a bare CUDA machine (torch and transformers installed, no network): installs
# the wheels `make gpu-wheels` put in bench/gpu-wheels/ (when a package is missing), then runs
# bench/gpu_check.py from the checkout. Arguments go to gpu_check.py (--device, --json, --tmp,
# --phases, --set; its docstring says what each phase must show and what it reports).
#   bash bench/gpu_check.sh --device cuda --json "$OUT/gpu_check.json"
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import pydantic, peft, rich" 2>/dev/null; then
  if ! ls bench/gpu-wheels/*.whl >/dev/null 2>&1; then
    echo "error: pydantic / peft / rich missing and no bench/gpu-wheels/: run make gpu-wheels on a machine with PyPI and bring the folder" >&2
    exit 2
  fi
  "$PYTHON" -m pip install --disable-pip-version-check -q --no-index --no-deps bench/gpu-wheels/*.whl
fi
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" bench/gpu_check.py "$@"
