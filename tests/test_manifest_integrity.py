"""The training checkpoint's manifest and commit pointer refuse every single-bit flip.

``COMMITTED`` records the sha256 of the step directory's ``manifest.json`` and of its own
canonical body, and both are parsed by a strict schema, so no altered byte of either file is
trusted: each flip raises :class:`TrainingCheckpointError` naming the file. The checkpoint
here is written through the module's own writers, without training: these files are all
that is checked before any data file is read.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gpt_training import dcp_checkpoint
from gpt_training.dcp_checkpoint import (
    COMMITTED,
    MANIFEST,
    Manifest,
    RunLayout,
    commit_pointer,
    read_manifest,
    write_manifest,
)
from gpt_training.errors import TrainingCheckpointError

from rng_tracker.errors import RNGTrackerError

RUN_ID = "0123456789abcdef0123456789abcdef"
STEP_DIR = "step-00000003-01234567-89abcdef"


def _checkpoint(path: Path) -> Manifest:
    """A committed checkpoint of step 3 with one data file, written as the job writes one."""
    directory = path / STEP_DIR
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(b"tensor bytes")
    manifest = Manifest(
        format=dcp_checkpoint.FORMAT,
        run_id=RUN_ID,
        step=3,
        rng_mode="keyed",
        seed=1234,
        global_batch=16,
        layout=RunLayout(tp=2, dp=2, pp=1, microbatches=1, sp=True),
        losses=[4.448866, 3.525343, 3.29805],
        has_optimizer=True,
        files={"__0_0.distcp": dcp_checkpoint._sha256(str(directory / "__0_0.distcp"))},
        directory=STEP_DIR,
    )
    commit_pointer(str(path), manifest, write_manifest(str(directory), manifest))
    return manifest


def _flips_refused(path: Path, target: Path) -> tuple[int, list[str]]:
    """Flip each bit of ``target`` in turn; the flips that were not refused as they must be."""
    original = target.read_bytes()
    wrong = []
    for bit in range(len(original) * 8):
        data = bytearray(original)
        data[bit // 8] ^= 1 << (bit % 8)
        target.write_bytes(bytes(data))
        try:
            read_manifest(str(path))
            wrong.append(f"bit {bit}: accepted")
        except TrainingCheckpointError as exc:
            if str(target) not in str(exc):
                wrong.append(f"bit {bit}: message does not name the file: {exc}")
        except Exception as exc:
            wrong.append(f"bit {bit}: {type(exc).__name__}: {exc}")
    target.write_bytes(original)
    return len(original) * 8, wrong


def test_the_written_checkpoint_reads_back_equal(tmp_path):
    """The writers and the reader agree: every field round-trips exactly."""
    written = _checkpoint(tmp_path)
    got = read_manifest(str(tmp_path))
    assert got == Manifest(
        **{**{f: getattr(written, f) for f in Manifest.__slots__}, "directory": got.directory}
    )
    assert got.losses == written.losses and got.files == written.files
    assert got.directory == os.path.join(str(tmp_path), STEP_DIR)


@pytest.mark.parametrize("name", [MANIFEST, COMMITTED])
def test_every_single_bit_flip_is_refused_naming_the_file(tmp_path, name):
    """All 8 x len(file) single-bit flips of manifest.json and of COMMITTED: each raises
    TrainingCheckpointError (also a RuntimeError) whose message names the flipped file."""
    _checkpoint(tmp_path)
    target = tmp_path / STEP_DIR / name if name == MANIFEST else tmp_path / name
    flips, wrong = _flips_refused(tmp_path, target)
    assert flips > 1000 and not wrong, wrong[:10]
    assert read_manifest(str(tmp_path)).step == 3  # restored: the check itself changed nothing
    assert issubclass(TrainingCheckpointError, RNGTrackerError)
    assert issubclass(TrainingCheckpointError, RuntimeError)


def test_a_missing_path_says_it_does_not_exist(tmp_path):
    """A mistyped --resume path is named as missing, not as a save that did not finish."""
    with pytest.raises(TrainingCheckpointError, match="does not exist"):
        read_manifest(str(tmp_path / "no-such-dir"))
    with pytest.raises(TrainingCheckpointError, match="holds no committed checkpoint"):
        read_manifest(str(tmp_path))
