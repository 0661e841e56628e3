#!/usr/bin/env bash
# The main job: a 4-rank CPU training demo of TinyGPT (tp=2 x dp=2, sequence parallel,
# selective recompute, layout-invariant dropout), then an exact resume from its checkpoint.
# Creates or reuses .venv ($VENV) and installs what it needs (CPU torch 2.13.0 if no torch).
# DEMO_STEPS (default 40) sets the first run's length; the resume adds half as many.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh
python -m pip install --quiet -e .
steps=${DEMO_STEPS:-40}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--tp 2 --dp 2 --sp --recompute selective --rng-mode invariant --seed 1234)
torchrun --standalone --nproc-per-node 4 scripts/train.py "${common[@]}" --steps "$steps" --save "$out/ckpt" --log-every 2 "$@"
echo
echo "== resuming from the checkpoint in fresh processes for $((steps / 2)) more steps =="
torchrun --standalone --nproc-per-node 4 scripts/train.py "${common[@]}" --steps "$((steps + steps / 2))" --resume "$out/ckpt" --log-every 2 "$@"
