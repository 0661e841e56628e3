# Sourced by test.sh and demo.sh: create or reuse the venv $VENV (default .venv), activate it,
# and make sure torch is importable (the CPU build 2.13.0 when none is), without ever pulling a
# CUDA build.
python=${PYTHON:-python3}
venv=${VENV:-.venv}
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -c "import torch" 2>/dev/null || python -m pip install --quiet torch==2.13.0
