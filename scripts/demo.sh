#!/usr/bin/env bash
# The main job: a 4-rank CPU training demo of TinyGPT (tp=2 x dp=2, sequence parallel,
# selective recompute, layout-invariant dropout), then an exact resume from its checkpoint.
# Creates or reuses .venv and installs what it needs (CPU torch 2.13.0 if no torch).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh
python -m pip install --quiet -e .
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--tp 2 --dp 2 --sp --recompute selective --rng-mode invariant --seed 1234)
torchrun --standalone --nproc-per-node 4 scripts/train.py "${common[@]}" --steps 40 --save "$out/ckpt" --log-every 2 "$@"
echo
echo "== resuming from the checkpoint in fresh processes for 20 more steps =="
torchrun --standalone --nproc-per-node 4 scripts/train.py "${common[@]}" --steps 60 --resume "$out/ckpt" --log-every 2 "$@"
