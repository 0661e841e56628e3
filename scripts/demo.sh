#!/usr/bin/env bash
# The main job: TinyGPT on 4 CPU ranks with keyed dropout. 20 steps at tp=2 x dp=2 (sequence
# parallel, selective recompute), a DCP checkpoint, then a resume in fresh processes on
# another layout (tp=2 x pp=2, 2 microbatches per step) for 20 more steps.
# Creates or reuses .venv ($VENV) and installs what it needs (CPU torch 2.13.0 if no torch).
# DEMO_STEPS (default 20) sets the first run's length; the resume adds as many.
# The checkpoint stays in $DEMO_OUT/ckpt (default: out/demo/ckpt under the directory the
# script is started from), replaced by each run of the demo, so it can be resumed afterwards.
set -euo pipefail
out=${DEMO_OUT:-$PWD/out/demo}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh
# install this checkout unless the venv already imports it from here (-I: not from the current
# directory, where the source folder rng_tracker/ would be found without being installed)
python -I -c 'import os, sys, rng_tracker; sys.exit(not rng_tracker.__file__.startswith(os.getcwd() + os.sep))' \
    2>/dev/null || python -m pip install --quiet -e .
steps=${DEMO_STEPS:-20}
ckpt="$out/ckpt"
common=(--nproc-per-node 4 --rng-mode keyed --recompute selective --global-batch 16 --seed 1234)
python scripts/train.py "${common[@]}" --tp 2 --dp 2 --sp --steps "$steps" \
    --save "$ckpt" --overwrite "$@"
echo
echo "== resuming from the checkpoint in fresh processes on tp=2 x pp=2 for $steps more steps =="
python scripts/train.py "${common[@]}" --tp 2 --pp 2 --microbatches 2 \
    --steps "$((2 * steps))" --resume "$ckpt" "$@"
if [[ -f "$ckpt/COMMITTED" ]]; then
    echo
    echo "the step-$steps checkpoint stays in $ckpt; to train on from it, e.g.:"
    echo "  python scripts/train.py ${common[*]} --tp 2 --pp 2 --microbatches 2 --steps $((3 * steps)) --resume $ckpt"
fi
