"""scripts/train.py refuses every argument it cannot run before any rank starts work.

Each refusal is a typed error (an ``RNGTrackerError`` and a ``ValueError``) printed as one line
on stderr, exit status 2, no traceback, nothing trained or written. Most cases call the
script's ``main`` in this process (it returns before any process group exists); a few run it as
a real process, alone and with ``--nproc-per-node``, to show the same from the outside.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist
from gpt_training.dcp_checkpoint import (
    FORMAT,
    Manifest,
    RunLayout,
    commit_pointer,
    read_manifest,
    write_manifest,
)
from gpt_training.errors import SaveTargetError, TrainArgumentError
from gpt_training.trainer import TrainConfig, check_save_target, preflight

from rng_tracker.errors import RNGTrackerError
from rng_tracker.parallel.transformer import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train.py"
KEYED = GPTConfig(rng_mode="keyed")  # the CLI's model with --rng-mode keyed


def _script():
    spec = importlib.util.spec_from_file_location("train_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_script = _script()


def _checkpoint(path: Path, *, step: int = 3, run_id: str = "ab" * 16) -> Path:
    """A committed checkpoint (keyed, seed 1234, batch 16, one rank) written without training."""
    name = f"step-{step:08d}-{run_id[:8]}-0000cafe"
    (path / name).mkdir(parents=True)
    manifest = Manifest(
        format=FORMAT,
        run_id=run_id,
        step=step,
        rng_mode="keyed",
        seed=1234,
        global_batch=16,
        layout=RunLayout(tp=1, dp=1, pp=1, microbatches=1, sp=False),
        losses=[4.0] * step,
        has_optimizer=step > 0,
        files={},
        directory=name,
    )
    commit_pointer(str(path), manifest, write_manifest(str(path / name), manifest))
    return path


def _refused(capsys, argv: list[str]) -> str:
    """Run main(argv) here: it must exit 2 with one line on stderr and start nothing."""
    try:
        code = train_script.main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    assert out == "" and not dist.is_initialized(), argv  # nothing started
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--steps", "0"], "TrainArgumentError: --steps must be a positive integer"),
        (["--steps", "-3"], "--steps must be a positive integer"),
        (["--tp", "0"], "--tp must be a positive integer"),
        (["--tp", "3"], "use --tp 1, 2 or 4"),
        (["--tp", "8"], "use --tp 1, 2 or 4"),
        (["--pp", "0"], "--pp must be a positive integer"),
        (["--pp", "3"], "exceeds TinyGPT's 2 layers"),
        (["--dp", "0"], "--dp must be a positive integer"),
        (["--dp", "2"], "must equal the number of processes (1)"),
        (["--microbatches", "0"], "--microbatches must be a positive integer"),
        (["--microbatches", "3"], "choose a multiple of 3"),
        (["--global-batch", "0"], "--global-batch must be a positive integer"),
        (["--log-every", "0"], "--log-every must be a positive integer"),
        (["--seed", "-1"], "--seed must be an integer in [0, 2**64)"),
        (["--seed", str(2**64)], "--seed must be an integer in [0, 2**64)"),
        (["--nproc-per-node", "2", "--tp", "3"], "use --tp 1, 2 or 4"),
        (["--nproc-per-node", "4", "--tp", "2", "--microbatches", "3"], "multiple of 6"),
        (["--nproc-per-node", "3", "--tp", "2"], "does not divide the 3 processes"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be a positive integer"),
        # the pipeline schedule failed in every rank, after torchrun started them
        (["--nproc-per-node", "4", "--tp", "2", "--pp", "2"], "at least as many microbatches"),
        # every rank failed in torch's sampler with a traceback
        (["--global-batch", str(2**66)], "--global-batch must be at most 2147483647"),
        (["--steps", "abc"], "invalid int value: 'abc'"),
        (["--rng-mode", "fast"], "invalid choice: 'fast'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2_before_any_work(capsys, argv, words):
    """Each of these crashed mid-run or trained on main (IndexError, ZeroDivisionError, a
    'multiple of 1' hint, a --tp the vocab cannot split): now refused before anything starts."""
    assert words in _refused(capsys, argv)


def test_a_save_target_that_is_a_file_is_refused_before_training(capsys, tmp_path):
    """--save onto an existing file, or below one, is refused up front; the file is untouched."""
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    line = _refused(capsys, ["--steps", "1", "--save", str(target)])
    assert "SaveTargetError" in line and "not a directory" in line
    assert "cannot be created" in _refused(capsys, ["--save", str(target / "ckpt")])
    assert target.read_text() == "mine"
    with pytest.raises(SaveTargetError) as info:
        check_save_target(str(target))
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)


def test_saving_over_another_runs_checkpoint_needs_overwrite(capsys, tmp_path):
    """A directory holding another run's committed checkpoint is refused without --overwrite;
    with it, or when the run resumes from that very checkpoint, the target is accepted."""
    other = _checkpoint(tmp_path / "other", run_id="cd" * 16)
    line = _refused(capsys, ["--rng-mode", "keyed", "--save", str(other)])
    assert "run cdcdcdcd" in line and "--overwrite" in line
    assert read_manifest(str(other)).run_id == "cd" * 16  # untouched
    preflight(TrainConfig(model=KEYED, global_batch=16, save=str(other), overwrite=True), world=1)
    own = TrainConfig(model=KEYED, global_batch=16, steps=5, save=str(other), resume=str(other))
    assert preflight(own, world=1).step == 3
    mine = _checkpoint(tmp_path / "mine", run_id="ef" * 16)
    with pytest.raises(SaveTargetError, match="run cdcdcdcd"):  # resuming another run
        check_save_target(str(other), resume=str(mine))


def test_a_resume_that_would_train_nothing_says_so(capsys, tmp_path):
    """--steps at or below the checkpoint's step exited 0 having trained nothing on main."""
    ckpt = _checkpoint(tmp_path / "ckpt", step=3)
    for steps in ("3", "2"):
        line = _refused(capsys, ["--rng-mode", "keyed", "--steps", steps, "--resume", str(ckpt)])
        assert "TrainArgumentError" in line and "would train nothing" in line
        assert "pass --steps above 3" in line


def test_a_mistyped_resume_path_is_named_as_missing(capsys, tmp_path):
    """Not 'the save that wrote it did not finish', as main said."""
    line = _refused(capsys, ["--resume", str(tmp_path / "ckpy")])
    assert "does not exist" in line and "did not finish" not in line
    with pytest.raises(TrainArgumentError):
        preflight(TrainConfig(resume=str(tmp_path / "ckpy")), world=1)


def test_a_resume_the_checkpoint_refuses_is_refused_before_any_rank_starts(capsys, tmp_path):
    """Another seed than the checkpoint's: ResumeRefusedError, one line, before any work."""
    ckpt = _checkpoint(tmp_path / "ckpt")
    argv = ["--rng-mode", "keyed", "--steps", "5", "--seed", "7", "--resume", str(ckpt)]
    assert "ResumeRefusedError" in _refused(capsys, argv)


@pytest.mark.parametrize(
    "argv",
    [["--steps", "0"], ["--nproc-per-node", "2", "--tp", "3"], ["--tp", "two"]],
    ids=["alone", "nproc-per-node", "argparse"],
)
def test_as_a_process_the_refusal_is_one_line_and_exit_2(argv):
    """The real script, run as a user runs it: exit 2, one stderr line, no traceback; with
    --nproc-per-node the check runs before torchrun would start any rank."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_under_a_plain_torchrun_every_rank_prints_the_refusal():
    """Started by torchrun (RANK and WORLD_SIZE set), each rank checks and exits 2. Only rank 0
    printed the reason, and torchrun may stop rank 0 once another rank has exited first (1 run
    in 6 showed no reason at all); now each rank prints it, after its rank (rank 1 here: rank 0
    printed before too)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tp", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "RANK": "1", "WORLD_SIZE": "2"},
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rank 1: error: "), proc.stderr
    assert "TrainArgumentError" in lines[0] and proc.stdout == ""


def test_an_empty_save_is_refused_before_training(capsys, tmp_path):
    """On main ``--save ""`` trained every step, saved nothing and exited 0: the run was lost."""
    line = _refused(capsys, ["--rng-mode", "keyed", "--steps", "1", "--save", ""])
    assert "SaveTargetError" in line and "--save is empty" in line
    with pytest.raises(SaveTargetError):
        preflight(TrainConfig(save=""), world=1)


def test_preflight_proves_the_save_target_writable_by_creating_an_entry(capsys, tmp_path):
    """As root (CI, containers) ``os.access`` says yes under /proc, so main trained every step and
    lost the run at the commit; the probe (create and remove an entry) refuses it up front, and
    leaves nothing behind in a writable target."""
    line = _refused(capsys, ["--rng-mode", "keyed", "--steps", "1", "--save", "/proc/ckpt"])
    assert "SaveTargetError" in line and "creating an entry in /proc failed" in line
    target = tmp_path / "out"
    target.mkdir()
    check_save_target(str(target))
    check_save_target(str(target / "new" / "ckpt"))  # probed in the nearest existing parent
    assert list(target.iterdir()) == [] and not (target / "new").exists()


def _save_then_fail_the_commit(ckpt: str) -> tuple:
    """Save step 2 into ckpt; make its commit pointer's temporary path a directory, so the next
    commit fails for real (the OS refuses to write it); resume and save step 4 there."""
    from _small_run import small_run
    from gpt_training.dcp_checkpoint import COMMITTED
    from gpt_training.errors import SaveCommitError
    from gpt_training.trainer import train

    cfg = small_run(
        rng_mode="keyed", global_batch=4, verify=False, steps=2, save=ckpt, pp=2, microbatches=2
    )
    train(cfg)
    if dist.get_rank() == 0:
        os.mkdir(os.path.join(ckpt, COMMITTED + ".tmp"))
    dist.barrier()
    try:
        train(replace(cfg, steps=4, resume=ckpt))
    except SaveCommitError as exc:
        return type(exc).__mro__[1].__name__, str(exc)
    return None, None


def test_a_save_that_fails_at_commit_keeps_the_previous_checkpoint_and_rescues_the_run(tmp_path):
    """pp=2 on 2 ranks: the commit of step 4 fails (the OS refuses the pointer's write). Every rank
    raises one typed SaveCommitError (a TrainingCheckpointError, so train.py prints it as one line,
    exit 2) naming the cause, that the step-2 checkpoint is kept, and the rescue directory that
    holds step 4 committed; on main rank 0 raised a raw IsADirectoryError and rank 1 waited."""
    from rng_tracker.parallel.testing import run_distributed

    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_save_then_fail_the_commit, world_size=2, args=(ckpt,), timeout=240)
    assert results[0] == results[1] and results[0][0] == "TrainingCheckpointError", results
    message = results[0][1]
    assert "IsADirectoryError" in message and "is still the committed one" in message
    assert read_manifest(ckpt).step == 2  # kept, every file checked against its hash
    rescue = message.split("was committed to ")[1].split(" instead")[0]
    try:
        rescued = read_manifest(rescue)
        assert rescued.step == 4 and rescued.run_id == read_manifest(ckpt).run_id
        assert f"resume with --resume {rescue}" in message
    finally:
        shutil.rmtree(rescue, ignore_errors=True)


def test_a_save_removes_only_the_directories_saves_wrote(tmp_path):
    """A save removes the step directories of earlier saves in its target, and nothing else:
    a user's step-by-step-notes/ and .tmp-build/ there were deleted with them."""
    save = tmp_path / "ckpt"
    notes, build = save / "step-by-step-notes", save / ".tmp-build"
    stale = save / "step-00000001-aaaaaaaa-bbbbbbbb"  # a save's leftover: removed as before
    for directory in (notes, build, stale):
        directory.mkdir(parents=True)
    (notes / "notes.txt").write_text("precious")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "1", "--save", str(save)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert (notes / "notes.txt").read_text() == "precious" and build.is_dir()
    assert not stale.exists() and read_manifest(str(save)).step == 1


def test_a_save_inside_a_checkpoints_step_directory_is_refused(capsys, tmp_path):
    """--save into the resumed checkpoint's own step directory committed there, and the
    checkpoint's file list no longer matched its manifest: no resume could load it again."""
    ckpt = _checkpoint(tmp_path / "ckpt")
    step_dir = ckpt / read_manifest(str(ckpt)).directory
    for target in (step_dir, step_dir / "deeper"):
        argv = ["--rng-mode", "keyed", "--steps", "5", "--resume", str(ckpt), "--save", str(target)]
        line = _refused(capsys, argv)
        assert "SaveTargetError" in line and "a step directory of the checkpoint" in line
    assert read_manifest(str(ckpt)).step == 3  # still loads: untouched


def _processes_naming(text: str) -> list[int]:
    """The pids of this machine's processes whose command line holds ``text``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:  # gone meanwhile
                continue
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads processes from /proc (Linux)")
def test_a_sigterm_to_the_launcher_stops_the_job(tmp_path):
    """train.py --nproc-per-node runs torchrun as its child. A SIGTERM to it (what timeout and
    kill send) left torchrun and every rank training on, detached, to commit a checkpoint
    later; it is passed on now: the job ends with its launcher and commits nothing."""
    save = str(tmp_path / "sigterm-ckpt")
    argv = ["--nproc-per-node", "2", "--steps", "100000", "--log-every", "1", "--save", save]
    job = subprocess.Popen(
        [sys.executable, str(SCRIPT), *argv], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    try:
        # the ranks train once rank 0 logs a step (a job that never started proves nothing)
        assert any(line.startswith("step") for line in job.stdout)
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=120)
        deadline = time.monotonic() + 60
        while _processes_naming(save) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_naming(save) == []
        assert not os.path.exists(os.path.join(save, "COMMITTED"))
    finally:
        job.kill()
        for pid in _processes_naming(save):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
