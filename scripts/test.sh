#!/usr/bin/env bash
# The test command. Creates or reuses .venv, installs rng_tracker editable with its test
# and kernel extras (and the CPU torch 2.13.0 when no torch is importable), runs pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh
python -m pip install --quiet -e '.[test,kernels]'
exec python -m pytest -n auto "$@"
