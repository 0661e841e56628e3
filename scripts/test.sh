#!/usr/bin/env bash
# The test command. Creates or reuses .venv, installs rng_tracker editable with its test,
# kernel and integration extras (and the CPU torch 2.13.0 when no torch is importable), the pinned
# frameworks of scripts/frameworks.txt without their dependencies, and runs pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh
python -m pip install --quiet -e '.[test,kernels,integration]'
python -m pip install --quiet --no-deps --ignore-requires-python -r scripts/frameworks.txt
exec python -m pytest -n auto "$@"
