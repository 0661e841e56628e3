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


def _save_on_each_node(base: str, saved_by: str) -> dict:
    """4 processes as 2 nodes of 2 (LOCAL_RANK = rank % 2), each node writing to its own
    directory, as on nodes without a shared file system: save, draw on, load, draw again."""
    import os

    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    from rng_tracker.dcp import RNGStateful
    from rng_tracker.errors import StateDictError

    rank = dist.get_rank()
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank % 2), "2"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # accelerate asks for it on several nodes
    config = ProjectConfiguration(save_on_each_node=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    set_seed(1234, device_specific=True)
    accelerator.register_for_checkpointing(RNGStateful(saved_by=saved_by))
    accelerator.prepare(torch.nn.Linear(4, 4))
    node_dir = os.path.join(base, f"node{rank // 2}")
    torch.rand(3)
    accelerator.save_state(node_dir)
    accelerator.wait_for_everyone()
    at_save = torch.get_rng_state()
    torch.rand(5)
    out: dict = {"local_main": accelerator.is_local_main_process}
    written = torch.load(os.path.join(node_dir, "custom_checkpoint_0.pkl"), weights_only=False)
    out["entries"] = sorted(written)
    try:
        accelerator.load_state(node_dir)
    except StateDictError as exc:  # the main-process form's refusal, typed
        out["error"] = str(exc)
        return out
    out["restored"] = torch.equal(torch.get_rng_state(), at_save)
    return out


def test_accelerate_save_on_each_node_restores_every_rank(tmp_path) -> None:
    """accelerate's ``save_on_each_node=True`` writes the registered state from each node's local
    main process and reads it on every process of that node. Under ``saved_by="auto"`` every
    node's file holds every rank's entry and each rank's generator comes back bitwise; the
    main-process form, which node 1's local main writes with its own entry only, refuses every
    rank's load and says why."""
    from rng_tracker.parallel.testing import run_distributed

    results = run_distributed(
        _save_on_each_node, world_size=4, args=(str(tmp_path / "auto"), "auto"), timeout=240
    )
    assert [r["local_main"] for r in results] == [True, False, True, False]
    for result in results:
        assert result["entries"] == ["rank0", "rank1", "rank2", "rank3", "shared"]
        assert result.get("error") is None and result["restored"]

    main_only = run_distributed(
        _save_on_each_node, world_size=4, args=(str(tmp_path / "main"), "main_process"), timeout=240
    )
    assert [r["entries"] for r in main_only[2:]] == [["rank2", "shared"]] * 2
    for result in main_only:
        assert "restored" not in result
    # node 1's file lacks rank 3's entry: rank 3 says so, and every other rank refuses with it
    assert "lacks this rank's entry 'rank3'" in main_only[3]["error"]
    assert "saved_by='each_node'" in main_only[3]["error"]
    assert all("rank 3 refused" in r["error"] for r in main_only[:3])
