#!/usr/bin/env bash
# The test command. Creates or reuses .venv, installs rng_tracker editable with its test
# and kernel extras (and the CPU torch 2.13.0 when no torch is importable), runs pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
# shellcheck disable=SC1091
source .venv/bin/activate
python -c "import torch" 2>/dev/null || python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e '.[test,kernels]'
exec python -m pytest -n auto "$@"
