"""HF accelerate 1.15's own ``Accelerator(cpu=True)`` checkpointing ``RNGStateful`` across process counts.

Claim: saved by ``Accelerator.save_state`` on 2 processes seeded with accelerate's usual
``set_seed(1234, device_specific=True)`` (a different CPU seed per process) and registered with
``register_for_checkpointing(RNGStateful())``, ``load_state`` on 1 and on 4 processes loads on
every rank; the keyed masks of the next steps are bitwise those of the uninterrupted 2-process
run; the per-process CPU generators, which cannot move, are re-derived (one
``RNGStateRederivedWarning`` naming them): the same on every load, distinct per rank, and never
the state ``set_seed`` gives (which would replay the first steps' draws). On the saved process
count every generator is restored bitwise. accelerate is installed by scripts/test.sh (--no-deps,
scripts/frameworks.txt); its ``PartialState`` adopts the harness's initialised process group.
"""

from __future__ import annotations

import warnings

import accelerate  # noqa: F401  scripts/test.sh installs it (scripts/frameworks.txt): never skipped
import torch

_ROWS, _HIDDEN, _P = 8, 16, 0.5  # the global batch of a step: 8 rows, split over the processes


def _keyed_masks(steps: int) -> list[torch.Tensor]:
    """Each step's keyed mask of the whole global batch: every process draws its rows (its place
    in the batch as a Region), the rows are gathered; the keyed step advances once per step."""
    import torch.distributed as dist

    from rng_tracker import get_keyed_rng
    from rng_tracker.kernels import Region, dropout

    keyed = get_keyed_rng("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = _ROWS // world
    masks = []
    for _ in range(steps):
        seed = keyed.seed_tensor("block.0.dropout")
        local = dropout(
            torch.ones(rows, _HIDDEN),
            _P,
            shard=Region((_ROWS, _HIDDEN), (rank * rows, 0)),
            seed=seed,
        )
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        masks.append(torch.cat(parts) != 0)
        torch.rand(3)  # the run also draws from its per-process CPU generator
        keyed.advance()
    return masks


def _accelerator():
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from rng_tracker import get_keyed_rng
    from rng_tracker.dcp import RNGStateful

    accelerator = Accelerator(cpu=True)
    set_seed(1234, device_specific=True)  # accelerate's usual setting: seed + process index
    keyed = get_keyed_rng("cpu")
    keyed.manual_seed(1234)  # the run's seed, the same on every process
    keyed.register("block.0.dropout")
    accelerator.register_for_checkpointing(RNGStateful())
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator


def _save_and_go_on(path: str) -> dict:
    """2 processes: 2 steps, save_state, then 2 more steps (the uninterrupted run); and a load on
    this same process count, which must restore every generator bitwise."""
    accelerator = _accelerator()
    _keyed_masks(2)
    accelerator.save_state(path)
    cpu_at_save = torch.get_rng_state()
    after = _keyed_masks(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no re-derivation on the saved layout
        warnings.filterwarnings("ignore", message=".*OMP_NUM_THREADS")
        accelerator.load_state(path)
    return {
        "masks": after,
        "same_count_cpu_restored": torch.equal(torch.get_rng_state(), cpu_at_save),
    }


def _resume(path: str) -> dict:
    from rng_tracker import get_keyed_rng
    from rng_tracker.errors import RNGStateRederivedWarning

    accelerator = _accelerator()
    seeded = torch.get_rng_state()  # what set_seed gives this process: the first steps' draws
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(path)
    rederived = [str(w.message) for w in caught if w.category is RNGStateRederivedWarning]
    cpu = torch.get_rng_state()
    return {
        "step": get_keyed_rng("cpu").step,
        "masks": _keyed_masks(2),
        "warnings": rederived,
        "cpu": cpu,
        "replays_set_seed": torch.equal(cpu, seeded),
    }


def test_accelerate_save_on_2_processes_load_on_1_and_4(tmp_path) -> None:
    from rng_tracker.parallel.testing import run_distributed

    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save_and_go_on, world_size=2, args=(path,), timeout=240)
    assert all(r["same_count_cpu_restored"] for r in saved)
    want = saved[0]["masks"]
    one = run_distributed(_resume, world_size=1, args=(path,), timeout=240)
    four = run_distributed(_resume, world_size=4, args=(path,), timeout=240)
    for result in one + four:
        assert result["step"] == 2
        assert len(result["masks"]) == len(want)
        for step, (got, expected) in enumerate(zip(result["masks"], want, strict=True)):
            assert torch.equal(got, expected), f"step {step + 3} mask differs after the resume"
        assert len(result["warnings"]) == 1 and "the CPU default generator" in result["warnings"][0]
        assert not result["replays_set_seed"]
    # re-derived from (run seed, saved step, the rank's coordinates): deterministic, distinct per rank
    assert torch.equal(one[0]["cpu"], four[0]["cpu"])
    states = [r["cpu"] for r in four]
    assert all(not torch.equal(a, b) for i, a in enumerate(states) for b in states[i + 1 :])
