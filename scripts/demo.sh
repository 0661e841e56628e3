#!/usr/bin/env bash
# The main job: TinyGPT on 4 CPU ranks with keyed dropout. 20 steps at tp=2 x dp=2 (sequence
# parallel, selective recompute), a DCP checkpoint, then a resume in fresh processes on
# another layout (tp=2 x pp=2, 2 microbatches per step) for 20 more steps.
# Creates or reuses .venv ($VENV) and installs what it needs (CPU torch 2.13.0 if no torch).
# DEMO_STEPS (default 20) sets the first run's length; the resume adds as many.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh
python -m pip install --quiet -e .
steps=${DEMO_STEPS:-20}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--rng-mode keyed --recompute selective --global-batch 16 --seed 1234)
torchrun --standalone --nproc-per-node 4 scripts/train.py "${common[@]}" \
    --tp 2 --dp 2 --sp --steps "$steps" --save "$out/ckpt" "$@"
echo
echo "== resuming from the checkpoint in fresh processes on tp=2 x pp=2 for $steps more steps =="
torchrun --standalone --nproc-per-node 4 scripts/train.py "${common[@]}" \
    --tp 2 --pp 2 --microbatches 2 --steps "$((2 * steps))" --resume "$out/ckpt" "$@"
