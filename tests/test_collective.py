"""The library's collectives (rng_tracker._collective): Python objects cross ranks as bytes in
uint8 tensors, never pickled, so the DCP RNG state and the DTensor state check need no numpy."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rng_tracker._collective import (
    all_gather_bytes,
    all_gather_cat,
    all_gather_json,
    all_gather_tensor_tree,
    state_digest,
)


def _refuse_pickles(*args: object, **kwargs: object) -> None:
    raise AssertionError("a collective pickled a Python object")


@pytest.mark.distributed(world_size=3)
def test_gathers_every_ranks_payload_in_rank_order(rank: int) -> None:
    dist.all_gather_object = _refuse_pickles  # this rank's process is fresh and ends after
    payloads = [b"", b"\x00one\n", bytes(range(256)) * 3]  # empty, zeros and newlines, long
    assert all_gather_bytes(payloads[rank]) == payloads
    assert all_gather_bytes(b"") == [b""] * 3
    assert all_gather_json({"rank": rank, "s": "é\n"}) == [
        {"rank": r, "s": "é\n"} for r in range(3)
    ]

    tree = {
        "cpu": torch.get_rng_state(),
        "values": [torch.full((2, 3), float(rank)).t(), torch.tensor(rank, dtype=torch.bfloat16)],
        "flags": torch.tensor([True, rank == 1]),
        "empty": torch.zeros(0, 4, dtype=torch.int64),
        "streams": {"a\nb": {"seed": 2**64 - 1 - rank, "state": None}},
    }
    everyone = all_gather_tensor_tree(tree)
    assert len(everyone) == 3
    for r, got in enumerate(everyone):
        assert torch.equal(got["cpu"], torch.get_rng_state())
        assert torch.equal(got["values"][0], torch.full((3, 2), float(r)))
        assert got["values"][1].dtype == torch.bfloat16 and got["values"][1].shape == ()
        assert got["values"][1].item() == r
        assert got["flags"].tolist() == [True, r == 1]
        assert got["empty"].shape == (0, 4) and got["empty"].dtype == torch.int64
        assert got["streams"] == {"a\nb": {"seed": 2**64 - 1 - r, "state": None}}

    x = torch.arange(6.0).view(2, 3) + 10 * rank  # (2, 3) per rank
    assert torch.equal(
        all_gather_cat(x), torch.cat([torch.arange(6.0).view(2, 3) + 10 * r for r in range(3)])
    )
    assert all_gather_cat(x.t(), dim=1).shape == (3, 6)  # a non-contiguous input


def test_state_digest_is_the_blake2b_of_the_state_bytes() -> None:
    state = torch.get_rng_state()
    assert state_digest(state) == hashlib.blake2b(bytes(state.tolist()), digest_size=8).hexdigest()
    torch.manual_seed(1)
    other = torch.get_rng_state()
    assert state_digest(other) != state_digest(torch.manual_seed(2).get_state())


# Two ways to be without numpy in every process of a run (ranks included, via sitecustomize).
# HIDE_NUMPY: a finder that refuses numpy outright, even importlib's probe for it.
# NUMPY_ABSENT: numpy as if not installed (find_spec says None), as torch._dynamo, which the
# kernels import, probes for it.
HIDE_NUMPY = """
import importlib.abc, sys
class _NoNumpy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError("numpy is hidden: the base install has none", name=name)
sys.meta_path.insert(0, _NoNumpy())
"""
NUMPY_ABSENT = """
import sys
sys.modules["numpy"] = None
"""

_VERIFY_WITHOUT_NUMPY = textwrap.dedent(
    """
    from rng_tracker.parallel.testing import run_distributed

    def check():
        import sys
        assert "numpy" not in sys.modules
        from rng_tracker import model_parallel_seed
        from rng_tracker.parallel import destroy_model_parallel, init_model_parallel
        from rng_tracker.parallel._verify import verify_rng_consistency
        state = init_model_parallel(tensor=2)
        report = verify_rng_consistency(plan=model_parallel_seed(3, layout=state), strict=True)
        destroy_model_parallel()
        return report.ok

    if __name__ == "__main__":
        print("verified", run_distributed(check, world_size=2, timeout=60))
    """
)

_EXCHANGE_WITHOUT_NUMPY = textwrap.dedent(
    """
    from rng_tracker.parallel.testing import run_distributed

    def check():
        import sys
        import torch
        import torch.distributed as dist
        assert sys.modules["numpy"] is None

        def refuse(*args, **kwargs):
            raise AssertionError("a collective pickled a Python object")

        dist.all_gather_object = refuse
        from torch.distributed.device_mesh import init_device_mesh
        from rng_tracker.dcp import RNGStateful
        from rng_tracker.errors import RNGConsistencyError
        from rng_tracker.parallel.dtensor import assert_same_generator_state

        rank = dist.get_rank()
        torch.manual_seed(rank)
        saved = RNGStateful().state_dict()  # outside DCP: every rank's entry gathered to rank 0
        if rank == 0:
            torch.save(saved, "rng.pt")
        dist.barrier()
        torch.manual_seed(99)
        RNGStateful().load_state_dict(torch.load("rng.pt", weights_only=True))
        mine = torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(rank).get_state())
        ranks = [0, 1] if rank != 0 else sorted(int(k[4:]) for k in saved if k.startswith("rank"))
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(dist.get_rank())
        try:
            assert_same_generator_state(mesh)
            refused = False
        except RNGConsistencyError as error:
            refused = "differs across mesh" in str(error)
        torch.manual_seed(0)
        assert_same_generator_state(mesh)
        return sorted(ranks) == [0, 1] and mine and refused

    if __name__ == "__main__":
        print("exchanged", run_distributed(check, world_size=2, timeout=60))
    """
)


def _run_without_numpy(tmp_path: Path, sitecustomize: str, script: str) -> str:
    """stdout of ``script`` run in a process (and its ranks) set up by ``sitecustomize``."""
    (tmp_path / "sitecustomize.py").write_text(sitecustomize)
    path = tmp_path / "script.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    done = subprocess.run(
        [sys.executable, str(path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_verifier_runs_without_numpy(tmp_path: Path) -> None:
    """The base install has no numpy; every process of this run cannot import it."""
    assert "verified [True, True]" in _run_without_numpy(
        tmp_path, HIDE_NUMPY, _VERIFY_WITHOUT_NUMPY
    )


def test_dcp_state_and_dtensor_check_exchange_no_pickles_and_need_no_numpy(tmp_path: Path) -> None:
    """RNGStateful's save and load outside DCP (entries gathered to rank 0, each rank restores its
    own generator) and assert_same_generator_state() on two gloo ranks, in processes that cannot
    import numpy and whose all_gather_object raises."""
    assert "exchanged [True, True]" in _run_without_numpy(
        tmp_path, NUMPY_ABSENT, _EXCHANGE_WITHOUT_NUMPY
    )
