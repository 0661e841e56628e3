"""RNGStateful: a checkpoint that resumes on any layout, costs O(1) per rank, and detects corruption.

Claims (issues 23 and 26), each on real gloo ranks and real DCP checkpoints:

- The same layout restores every generator, stream and keyed state bitwise. Another layout or
  world size (2 -> 4 ranks, 2 -> 1) restores the keyed state and the shared streams bitwise and
  re-derives each per-rank stream from (run seed, saved step, the rank's new coordinates on the
  axes it varied over): ranks that share those coordinates get equal states, the others distinct
  ones, never the state the run's seeding gave (which would replay the first steps), with one
  ``RNGStateRederivedWarning`` naming them; ``strict=True`` refuses, changing nothing.
- An ``RNGStateful`` nested in another ``Stateful`` (torch's DCP tutorial's ``AppState``) saves
  and loads as one at the top level, on a grown world too; two nested in one are refused at load.
- Under DCP each rank holds two entries (``shared``, its own) of the same size at 2 and 4 ranks,
  sends the same bytes in our collectives, and reads ``shared`` plus its own entry (saved layout)
  or ``shared`` alone (another world size): never another rank's state.
- Every single-bit flip anywhere in a state dict (hundreds, at random), and every malformed
  payload, is refused with ``StateDictError`` and changes nothing; one rank's refusal makes every
  rank refuse, changing nothing anywhere; a save refuses, before writing, ranks that hold
  different streams or a keyed step that is not the trainer's.
- Format-1 checkpoints (written by the previous release) still load: replicated states on any
  layout, per-rank states on the saved layout, and elsewhere a typed error naming the format.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rng_tracker._keyed import KeyedRNG
from rng_tracker._tracker import RNGStatesTracker
from rng_tracker.dcp import RNGStateful
from rng_tracker.errors import (
    RNGStateLayoutError,
    RNGStateRederivedWarning,
    RNGStateSaveError,
    RNGTrackerError,
    StateDictError,
    TrackerBusyError,
)
from rng_tracker.parallel.testing import run_distributed

FORMAT1 = Path(__file__).resolve().parent / "data" / "rng_format1"
_MP = "model-parallel-rng"
_EP = "expert-parallel-rng"  # varies over etp, which follows tp here


def _digest(state: torch.Tensor) -> str:
    return hashlib.sha256(bytes(state.tolist())).hexdigest()


def _states(tracker: RNGStatesTracker, keyed: KeyedRNG) -> dict:
    """Everything an RNGStateful restores, as digests: CPU generator, streams, keyed state."""
    streams = tracker.state_dict()["streams"]
    return {
        "cpu": _digest(torch.get_rng_state()),
        **{f"stream/{n}": (_digest(e["state"]), e["seed"]) for n, e in streams.items()},
        "keyed": json.dumps(keyed.state_dict(), sort_keys=True),
        "keyed_seed": keyed.seed,
    }


class _Recorder(RNGStateful):
    """RNGStateful that keeps what its state_dict() returned (the bytes DCP took from it)."""

    def state_dict(self) -> dict:
        self.returned = super().state_dict()
        return self.returned


class _TrainState:
    """The Stateful of torch's DCP tutorial: its state_dict() holds an RNGStateful's."""

    def __init__(self, rng: RNGStateful) -> None:
        self.rng, self.step = rng, 3

    def state_dict(self) -> dict:
        return {"rng": self.rng.state_dict(), "step": self.step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.rng.load_state_dict(state_dict["rng"])
        self.step = state_dict["step"]


def _reader(path: str, read: list[str]):
    """DCP's own FileSystemReader, noting the keys of every item it reads."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_data(self, plan, planner):
            read.extend(item.storage_index.fqn for item in plan.items)
            return super().read_data(plan, planner)

    return Reader(path)


def _megatron_like(tensor: int, keyed_step: int) -> tuple[RNGStatesTracker, KeyedRNG, object]:
    """model_parallel_seed on a (tp=tensor) mesh: the default generator and data-parallel-rng are
    equal on every rank, model- and expert-parallel-rng differ over tp (etp); keyed seeded."""
    from rng_tracker._seeds import model_parallel_seed
    from rng_tracker.parallel._mesh import destroy_model_parallel, init_model_parallel

    destroy_model_parallel()
    state = init_model_parallel(tensor=tensor)
    tracker = RNGStatesTracker("cpu")
    model_parallel_seed(1234, tracker=tracker, layout=state)
    keyed = KeyedRNG("cpu", seed=1234)
    keyed.register("layer.0.dropout")
    keyed.set_step(keyed_step)
    with tracker.fork(_MP):
        torch.rand(5)  # the run has drawn: no stream is at its seeded state any more
    torch.rand(3)
    return tracker, keyed, state


def _fresh_model_parallel_state(tensor: int) -> str:
    """The model-parallel stream a fresh model_parallel_seed(1234) gives this rank (step 0)."""
    tracker = RNGStatesTracker("cpu")
    from rng_tracker._seeds import model_parallel_seed

    model_parallel_seed(
        1234, tracker=tracker, tp_rank=dist.get_rank() % tensor, pp_rank=0, dp_rank=0
    )
    return _digest(tracker.state_dict()["streams"][_MP]["state"])


# --- 2 ranks: save, same-layout loads, refusals --------------------------------------------------


def _save_at_tp2(root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from rng_tracker.dcp import comm_bytes
    from rng_tracker.parallel._mesh import destroy_model_parallel

    rank = dist.get_rank()
    out: dict = {}
    tracker, keyed, _ = _megatron_like(2, keyed_step=5)
    recorder = _Recorder(tracker, keyed, layout={"tp": 2})
    sent = comm_bytes()["sent"]
    dcp.save({"rng": recorder}, checkpoint_id=os.path.join(root, "tp2"))
    out["sent"] = comm_bytes()["sent"] - sent
    out["held"] = {key: len(value) for key, value in recorder.returned.items()}
    out["saved"] = _states(tracker, keyed)
    nested = _Recorder(tracker, keyed, layout={"tp": 2})
    dcp.save({"train": _TrainState(nested)}, checkpoint_id=os.path.join(root, "tp2-nested"))
    out["nested_held"] = sorted(nested.returned)

    # the saved layout: every state back bitwise, reading 'shared' and this rank's entry only
    with tracker.fork(_MP):
        torch.rand(7)
    torch.rand(7)
    keyed.set_step(9)
    read: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RNGStateRederivedWarning)
        dcp.load(
            {"rng": RNGStateful(tracker, keyed, layout={"tp": 2})},
            storage_reader=_reader(os.path.join(root, "tp2"), read),
        )
    out["same_layout_restored"] = _states(tracker, keyed) == out["saved"]
    out["same_layout_read"] = sorted(set(read))

    # the main-process form (accelerate's): every rank's entry on rank 0; one rank's bad entry
    # makes every rank refuse, and nothing changes on any rank
    everything = RNGStateful(tracker, keyed, layout={"tp": 2}).state_dict()
    if rank == 0:
        torch.save(everything, os.path.join(root, "main.pt"))
    dist.barrier()
    whole = torch.load(os.path.join(root, "main.pt"), weights_only=True)
    bad = dict(whole)
    flipped = bytearray(bad["rank1"])
    flipped[len(flipped) // 2] ^= 0x10
    bad["rank1"] = bytes(flipped)
    torch.manual_seed(99)
    before = _states(tracker, keyed)
    try:
        RNGStateful(tracker, keyed, layout={"tp": 2}).load_state_dict(bad)
        out["one_bad_entry"] = None
    except StateDictError as exc:
        out["one_bad_entry"] = (str(exc), _states(tracker, keyed) == before)
    RNGStateful(tracker, keyed, layout={"tp": 2}).load_state_dict(whole)
    out["main_form_restored"] = _states(tracker, keyed) == out["saved"]

    # strict=False is the default; strict=True on another layout refuses, changing nothing
    torch.manual_seed(98)
    before = _states(tracker, keyed)
    try:
        dcp.load(
            {"rng": RNGStateful(tracker, keyed, layout={"tp": 1}, strict=True)},
            checkpoint_id=os.path.join(root, "tp2"),
        )
        out["strict"] = None
    except RNGStateLayoutError as exc:
        out["strict"] = (str(exc), _states(tracker, keyed) == before)

    # a save that no load could restore is refused on every rank before anything is written
    other = RNGStatesTracker("cpu")
    other.add("data", 3)
    if rank == 1:
        other.add("extra", 4)
    out["different_streams"] = _refused_save(root, "streams", RNGStateful(other, keyed))
    step = RNGStateful(tracker, keyed, step=lambda: 4)  # the keyed step is 5
    out["keyed_not_trainer_step"] = _refused_save(root, "step", step)
    # a step callable that raises on one rank: every rank refuses (the others hung in the save)
    failing = RNGStateful(tracker, keyed, step=(lambda: {}["step"]) if rank == 0 else (lambda: 5))
    out["step_raises_on_rank_0"] = _refused_save(root, "raises", failing)
    # inside a fork the CPU generator holds the stream's state: it was saved as the generator's
    other_fork = RNGStatesTracker("cpu")
    other_fork.add("elsewhere", 9)
    with other_fork.fork("elsewhere") if rank == 1 else contextlib.nullcontext():
        out["in_a_fork_on_rank_1"] = _refused_save(root, "fork", RNGStateful(tracker, keyed))

    # format-1 checkpoints of the previous release load on their own layout
    format1 = {}
    for name in ("replicated", "per-rank"):
        tracker1, keyed1 = RNGStatesTracker("cpu"), KeyedRNG("cpu")
        dcp.load(
            {"rng": RNGStateful(tracker1, keyed1, layout={"tp": 2})},
            checkpoint_id=str(FORMAT1 / name),
        )
        format1[name] = _states(tracker1, keyed1)
    out["format1"] = format1
    destroy_model_parallel()
    _save_with_a_mesh(root)
    return out


def _mesh_run(shape: tuple[int, ...], names: tuple[str, ...]):
    """A DeviceMesh given as layout=: its named axes give the coordinates. The stream 'per-tp'
    varies over tp only, as a model-parallel stream does."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    tracker = RNGStatesTracker("cpu")
    tracker.add("per-tp", 500 + mesh.get_local_rank("tp"))
    keyed = KeyedRNG("cpu", seed=8)
    return mesh, tracker, keyed


def _save_with_a_mesh(root: str) -> None:
    import torch.distributed.checkpoint as dcp

    mesh, tracker, keyed = _mesh_run((2,), ("tp",))
    dcp.save({"rng": RNGStateful(tracker, keyed, layout=mesh)}, checkpoint_id=f"{root}/mesh")


def _load_with_a_mesh(root: str) -> tuple[int, str]:
    """Load the tp=2 mesh checkpoint on a (dp=2, tp=2) mesh: 'per-tp' re-derived per tp rank."""
    import torch.distributed.checkpoint as dcp

    mesh, tracker, keyed = _mesh_run((2, 2), ("dp", "tp"))
    with pytest.warns(RNGStateRederivedWarning, match="per-tp"):
        dcp.load({"rng": RNGStateful(tracker, keyed, layout=mesh)}, checkpoint_id=f"{root}/mesh")
    return mesh.get_local_rank("tp"), _digest(tracker.state_dict()["streams"]["per-tp"]["state"])


def _refused_save(root: str, name: str, stateful: RNGStateful):
    import torch.distributed.checkpoint as dcp

    path = os.path.join(root, name)
    try:
        dcp.save({"rng": stateful}, checkpoint_id=path)
        return None
    except RNGStateSaveError as exc:
        return str(exc), os.path.exists(os.path.join(path, ".metadata"))


# --- 4 ranks: a grown world and another layout --------------------------------------------------


def _load_at(root: str, tensor: int, *, nested: bool = False) -> dict:
    """Load the tp=2 checkpoint of 2 ranks on this run's mesh (tp=tensor over the world); nested:
    the one whose RNGStateful sat inside a _TrainState, loaded the same way."""
    import torch.distributed.checkpoint as dcp

    from rng_tracker.dcp import comm_bytes
    from rng_tracker.parallel._mesh import destroy_model_parallel

    tracker, keyed, state = _megatron_like(tensor, keyed_step=0)
    torch.manual_seed(77)  # elsewhere until the load
    read: list[str] = []
    stateful = RNGStateful(tracker, keyed, layout={"tp": tensor})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load(
            {"train": _TrainState(stateful)} if nested else {"rng": stateful},
            storage_reader=_reader(os.path.join(root, "tp2-nested" if nested else "tp2"), read),
        )
    out = {
        "restored": _states(tracker, keyed),
        "read": sorted(set(read)),
        "warnings": [str(w.message) for w in caught if w.category is RNGStateRederivedWarning],
        "tp": state.rank("tp"),
        "fresh_mp": _fresh_model_parallel_state(tensor),
    }
    if nested:
        destroy_model_parallel()
        return out
    # and a save here: the same bytes per rank as on 2 ranks
    recorder = _Recorder(tracker, keyed, layout={"tp": tensor})
    sent = comm_bytes()["sent"]
    dcp.save({"rng": recorder}, checkpoint_id=os.path.join(root, f"resaved-tp{tensor}"))
    out["sent"] = comm_bytes()["sent"] - sent
    out["held"] = {key: len(value) for key, value in recorder.returned.items()}
    destroy_model_parallel()
    return out


def _layout_from_the_parallel_state(root: str) -> list[str]:
    """No layout= given: saved at tp=4, loaded at tp=2 x dp=2 on the same 4 ranks. The layout is
    the parallel state's, so the per-tp streams are re-derived, not taken from another tp rank."""
    import torch.distributed.checkpoint as dcp

    from rng_tracker.parallel._mesh import destroy_model_parallel

    tracker, keyed, _ = _megatron_like(4, keyed_step=3)
    dcp.save({"rng": RNGStateful(tracker, keyed)}, checkpoint_id=f"{root}/no-layout")
    tracker, keyed, _ = _megatron_like(2, keyed_step=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load({"rng": RNGStateful(tracker, keyed)}, checkpoint_id=f"{root}/no-layout")
    destroy_model_parallel()
    return [str(w.message) for w in caught if w.category is RNGStateRederivedWarning]


def _layout_given_as_a_parallel_state(root: str) -> dict:
    """layout= a ParallelState (a ParallelLayout, as every other layout= takes): it was refused
    with "layout must be a str, a mapping of axis sizes or a DeviceMesh". Saved at tp=4, loaded
    at tp=4 (bitwise) and at tp=2 x dp=2 (the per-tp streams re-derived)."""
    import torch.distributed.checkpoint as dcp

    from rng_tracker.parallel._mesh import destroy_model_parallel

    tracker, keyed, state = _megatron_like(4, keyed_step=3)
    saved = _digest(tracker.state_dict()["streams"][_MP]["state"])
    dcp.save({"rng": RNGStateful(tracker, keyed, layout=state)}, checkpoint_id=f"{root}/state")
    out = {}
    for tensor in (4, 2):
        tracker, keyed, state = _megatron_like(tensor, keyed_step=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stateful = RNGStateful(tracker, keyed, layout=state)
            dcp.load({"rng": stateful}, checkpoint_id=f"{root}/state")
        out[tensor] = {
            "mp": _digest(tracker.state_dict()["streams"][_MP]["state"]),
            "tp": state.rank("tp"),
            "warnings": [str(w.message) for w in caught if w.category is RNGStateRederivedWarning],
        }
    destroy_model_parallel()
    return {"saved": saved, **out}


def _on_four_ranks(root: str) -> dict:
    return {
        "tp4": _load_at(root, 4),
        "tp4_nested": _load_at(root, 4, nested=True),
        "tp2dp2": _load_at(root, 2),
        "mesh": _load_with_a_mesh(root),
        "no_layout_given": _layout_from_the_parallel_state(root),
        "parallel_state_given": _layout_given_as_a_parallel_state(root),
    }


def _on_one_rank(root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    tracker, keyed = RNGStatesTracker("cpu"), KeyedRNG("cpu")
    read: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load(
            {"rng": RNGStateful(tracker, keyed)},
            storage_reader=_reader(os.path.join(root, "tp2"), read),
        )
    out = {
        "restored": _states(tracker, keyed),
        "read": sorted(set(read)),
        "warnings": [str(w.message) for w in caught if w.category is RNGStateRederivedWarning],
    }
    format1 = {}
    for name in ("replicated", "per-rank"):
        tracker1, keyed1 = RNGStatesTracker("cpu"), KeyedRNG("cpu")
        try:
            dcp.load({"rng": RNGStateful(tracker1, keyed1)}, checkpoint_id=str(FORMAT1 / name))
            format1[name] = _states(tracker1, keyed1)
        except RNGStateLayoutError as exc:
            format1[name] = str(exc)
    out["format1"] = format1
    return out


def test_resume_on_the_saved_layout_a_grown_world_another_mesh_and_one_process(tmp_path) -> None:
    root = str(tmp_path)
    two = run_distributed(_save_at_tp2, world_size=2, args=(root,), timeout=240)
    four = run_distributed(_on_four_ranks, world_size=4, args=(root,), timeout=240)
    one = run_distributed(_on_one_rank, world_size=1, args=(root,), timeout=240)[0]
    saved = [r["saved"] for r in two]
    shared_keys = ("cpu", "stream/data-parallel-rng", "keyed")

    # the saved layout: bitwise, DCP and main-process forms; reads its own entry only
    for rank, result in enumerate(two):
        assert result["same_layout_restored"] and result["main_form_restored"]
        assert result["same_layout_read"] == sorted(["rng.shared", f"rng.rank{rank}"])
        assert set(result["held"]) == {"shared", f"rank{rank}"}
        message, unchanged = result["one_bad_entry"]
        assert unchanged and ("checksum" in message if rank == 1 else "rank 1 refused" in message)
        message, unchanged = result["strict"]
        assert unchanged and "differs between the 2 saved ranks" in message
        assert f"tracker stream {_MP!r}" in message and f"tracker stream {_EP!r}" in message
        for case in (
            "different_streams",
            "keyed_not_trainer_step",
            "step_raises_on_rank_0",
            "in_a_fork_on_rank_1",
        ):
            message, written = result[case]
            assert not written, case
        assert "different generators and tracker streams" in result["different_streams"][0]
        assert "not the trainer's step 4" in result["keyed_not_trainer_step"][0]
        assert ("KeyError: 'step'" if rank == 0 else "rank 0 refused") in result[
            "step_raises_on_rank_0"
        ][0]
        assert (
            "inside open fork(s) ['elsewhere'] of the cpu tracker"
            if rank == 1
            else "rank 1 refused"
        ) in result["in_a_fork_on_rank_1"][0]
    assert (
        saved[0]["cpu"] == saved[1]["cpu"]
        and saved[0][f"stream/{_MP}"] != saved[1][f"stream/{_MP}"]
    )

    # a grown world (4 ranks) and another mesh (tp=2 x dp=2): shared parts bitwise, the per-rank
    # stream re-derived per tp coordinate, never the seeded state; one warning naming it
    for layout in ("tp4", "tp2dp2"):
        results = [r[layout] for r in four]
        for result in results:
            got = result["restored"]
            assert all(got[key] == saved[0][key] for key in shared_keys), layout
            assert got["keyed_seed"] == 1234
            assert got[f"stream/{_MP}"][0] not in (saved[0][f"stream/{_MP}"][0], result["fresh_mp"])
            assert result["read"] == ["rng.shared"]  # no rank's entry: nothing of another rank
            (warning,) = result["warnings"]
            assert f"tracker stream {_MP!r}" in warning and f"tracker stream {_EP!r}" in warning
            assert "the CPU default generator" not in warning
        for stream in (_MP, _EP):
            by_tp: dict[int, set] = {}
            for result in results:
                by_tp.setdefault(result["tp"], set()).add(result["restored"][f"stream/{stream}"])
            assert all(len(states) == 1 for states in by_tp.values()), layout  # equal within tp
            assert len(set().union(*by_tp.values())) == len(by_tp), layout  # distinct across tp

    # an RNGStateful nested in another Stateful (torch's DCP tutorial's shape): each rank saved
    # its own entry, and a grown world loads it as it loads one at the top level
    assert all(r["nested_held"] == [f"rank{i}", "shared"] for i, r in enumerate(two))
    for result in four:
        nested = result["tp4_nested"]
        assert nested["restored"] == result["tp4"]["restored"]
        assert nested["read"] == ["train.rng.shared", "train.step"]
        assert [len(nested["warnings"]), len(result["tp4"]["warnings"])] == [1, 1]

    # no layout= given: the parallel state's axis sizes tell tp=4 from tp=2 x dp=2 (same world)
    for result in four:
        assert len(result["no_layout_given"]) == 1, result["no_layout_given"]
        assert _MP in result["no_layout_given"][0]

    # layout= a ParallelState: bitwise on its own layout, per-tp streams re-derived elsewhere
    by_tp_state: dict[int, set] = {}
    for result in four:
        given = result["parallel_state_given"]
        assert given[4]["mp"] == given["saved"] and given[4]["warnings"] == []
        assert len(given[2]["warnings"]) == 1 and _MP in given[2]["warnings"][0]
        by_tp_state.setdefault(given[2]["tp"], set()).add(given[2]["mp"])
    assert sorted(by_tp_state) == [0, 1] and all(len(v) == 1 for v in by_tp_state.values())
    assert by_tp_state[0] != by_tp_state[1]

    # the same with a DeviceMesh as layout=: equal within a tp coordinate, distinct across
    by_tp_mesh: dict[int, set] = {}
    for result in four:
        by_tp_mesh.setdefault(result["mesh"][0], set()).add(result["mesh"][1])
    assert sorted(by_tp_mesh) == [0, 1] and all(len(v) == 1 for v in by_tp_mesh.values())
    assert by_tp_mesh[0] != by_tp_mesh[1]

    # O(1) per rank: two entries of the same size, the same collective bytes, at 2 and 4 ranks
    sizes_two = {sum(r["held"].values()) for r in two}
    sizes_four = {sum(r["tp4"]["held"].values()) for r in four}
    assert max(sizes_two | sizes_four) - min(sizes_two | sizes_four) <= 64, (sizes_two, sizes_four)
    assert {r["sent"] for r in two} == {r["tp4"]["sent"] for r in four}
    assert all(set(r["tp4"]["held"]) == {"shared", f"rank{i}"} for i, r in enumerate(four))

    # one process: shared parts bitwise, the per-rank stream re-derived
    assert all(one["restored"][key] == saved[0][key] for key in shared_keys)
    assert one["read"] == ["rng.shared"] and len(one["warnings"]) == 1

    # format 1: on its own layout every rank's own states; replicated ones anywhere; per-rank
    # ones elsewhere refused with a typed error naming the format and how to convert
    expected = json.loads((FORMAT1 / "expected.json").read_text())
    for rank, result in enumerate(two):
        for name in ("replicated", "per-rank"):
            got, want = result["format1"][name], expected[f"rank{rank}"][name]
            assert got["cpu"] == want["cpu"] and got["keyed_seed"] == 3
            streams = {k: v[0] for k, v in got.items() if k.startswith("stream/")}
            assert {"cpu": got["cpu"], **streams} == want
    assert one["format1"]["replicated"]["cpu"] == expected["rank0"]["replicated"]["cpu"]
    assert "format-1 checkpoint" in one["format1"]["per-rank"]
    assert "load it on the saved layout and save again" in one["format1"]["per-rank"]


# --- one process: corruption and malformed payloads ---------------------------------------------


def _setup() -> tuple[RNGStatesTracker, KeyedRNG]:
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 11)
    tracker.add("b", 12)
    keyed = KeyedRNG("cpu", seed=5)
    keyed.register("site.x")
    keyed.set_step(3)
    return tracker, keyed


def _save_main_form_on_two_ranks() -> dict:
    tracker = RNGStatesTracker("cpu")
    tracker.add("per-rank", 20 + dist.get_rank())
    tracker.add("shared", 30)
    keyed = KeyedRNG("cpu", seed=5)
    keyed.register("site.x")
    return RNGStateful(tracker, keyed).state_dict()


def _flip(state: dict, rng: random.Random) -> dict:
    """``state`` with one bit flipped somewhere in its keys' or values' bytes."""
    cells = [(key, which) for key in state for which in ("key", "value")]
    weights = [len(key) if which == "key" else len(state[key]) for key, which in cells]
    key, which = rng.choices(cells, weights)[0]
    if which == "key":
        raw = bytearray(key.encode())
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        new = raw.decode("latin-1")
        return {**{k: v for k, v in state.items() if k != key}, new: state[key]}
    raw = bytearray(state[key])
    raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    return {**state, key: bytes(raw)}


def test_every_single_bit_flip_is_refused_and_changes_nothing(tmp_path) -> None:
    """400 random single-bit flips over the keys and bytes of a 2-rank state dict (main-process
    form: 'shared', 'rank0', 'rank1'), loaded in one process: each is a StateDictError and the CPU
    generator, the streams and the (unseeded) keyed RNG are exactly as before. On main 122 of
    300 flips loaded silently."""
    state = run_distributed(_save_main_form_on_two_ranks, world_size=2, timeout=120)[0]
    assert set(state) == {"shared", "rank0", "rank1"}
    tracker = RNGStatesTracker("cpu")
    tracker.add("mine", 99)
    keyed = KeyedRNG("cpu")  # unseeded: a failed load must leave it so
    rng = random.Random(2026)
    before = _states(tracker, keyed)
    for _ in range(400):
        with pytest.raises(StateDictError):
            RNGStateful(tracker, keyed).load_state_dict(_flip(state, rng))
        assert _states(tracker, keyed) == before
    with pytest.warns(RNGStateRederivedWarning):  # the intact one loads (per-rank re-derived)
        RNGStateful(tracker, keyed).load_state_dict(state)
    assert keyed.seed == 5 and sorted(tracker.names()) == ["per-rank", "shared"]


def _forged(key: str, header: dict, parts: list[bytes]) -> bytes:
    """An entry with a valid checksum but content no RNGStateful writes (a hostile writer)."""
    from rng_tracker._rng_entries import encode_entry

    return encode_entry(key, header, parts)


def test_malformed_payloads_are_refused_typed_and_change_nothing() -> None:
    """Empty, garbage, truncated, mistyped, mislabelled and forged payloads: each a StateDictError
    (a ValueError) naming what is wrong; on main they raised EOFError, UnpicklingError, ValueError,
    KeyError, IndexError."""
    tracker, keyed = _setup()
    good = RNGStateful(tracker, keyed).state_dict()
    from rng_tracker._rng_entries import decode_entry

    shared_header, shared_blob, _ = decode_entry("shared", good["shared"])
    cases = {
        "not a mapping": [good["shared"]],
        "empty": {},
        "no shared": {"rank0": good["rank0"]},
        "unknown key": {**good, "rank-1": b""},
        "empty entry": {**good, "shared": b""},
        "garbage": {**good, "shared": b"\x80\x02garbage"},
        "truncated": {**good, "shared": good["shared"][: len(good["shared"]) // 2]},
        "not bytes": {**good, "shared": 42},
        "swapped keys": {"shared": good["rank0"], "rank0": good["shared"]},
        "format 1 garbage": {"blob": b"not a torch.save"},
        "format 1 empty": {"blob": b""},
        "format 1 not bytes": {"blob": [1, 2]},
        "forged: other format": {
            **good,
            "shared": _forged("shared", {**shared_header, "format": 3}, [shared_blob]),
        },
        "forged: bool world": {
            **good,
            "shared": _forged("shared", {**shared_header, "world": True}, [shared_blob]),
        },
        "forged: short blob": {
            **good,
            "shared": _forged("shared", shared_header, [shared_blob[:-1]]),
        },
        "forged: no cpu": {
            **good,
            "shared": _forged(
                "shared",
                {
                    **shared_header,
                    "parts": [p for p in shared_header["parts"] if p["name"] != "cpu"],
                },
                [shared_blob[5056:]],
            ),
        },
        "forged: bad cpu state": {
            **good,
            "shared": _forged("shared", shared_header, [b"\x00" * len(shared_blob)]),
        },
    }
    named = {  # what each message names
        "not a mapping": "expected the mapping RNGStateful.state_dict() returns, got list",
        "empty": "has the entries 'shared' and 'rank<r>'; got []",
        "no shared": "has the entries 'shared' and 'rank<r>'; got ['rank0']",
        "unknown key": "got ['rank-1', 'rank0', 'shared']",
        "empty entry": "'shared' (0 bytes) does not start with the format-2 marker",
        "garbage": "'shared' (9 bytes) does not start with the format-2 marker",
        "truncated": "'shared' does not match its checksum",
        "not bytes": "'shared' is a int, not bytes",
        "swapped keys": "'shared' does not match its checksum",
        "format 1 garbage": "a format-1 RNG state (rng_tracker <= da7a863) that does not decode",
        "format 1 empty": "a format-1 RNG state (rng_tracker <= da7a863) that does not decode",
        "format 1 not bytes": "a format-1 RNG state is {'blob': bytes}",
        "forged: other format": "RNG state of format 3",
        "forged: bool world": "shared entry's header is malformed",
        "forged: short blob": "lists 15168 bytes of states but holds 15167",
        "forged: no cpu": "shared entry's list of states is malformed",
        "forged: bad cpu state": "belongs to another save than its 'shared' entry",
    }
    assert named.keys() == cases.keys()
    torch.manual_seed(4)
    tracker.add("c", 13)
    keyed.set_step(8)
    before = _states(tracker, keyed)
    for name, payload in cases.items():
        with pytest.raises(StateDictError) as info:
            RNGStateful(tracker, keyed).load_state_dict(payload)
        assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)
        assert named[name] in str(info.value), (name, str(info.value))
        assert _states(tracker, keyed) == before, name


def test_a_refused_load_leaves_an_unseeded_keyed_rng_unseeded() -> None:
    """Loading inside an open fork is refused before anything changes: on main the keyed state
    was applied first and not put back when it had been unseeded (its seed stayed changed)."""
    tracker, keyed = _setup()
    state = RNGStateful(tracker, keyed).state_dict()
    fresh = KeyedRNG("cpu")
    with tracker.fork("a"), pytest.raises(TrackerBusyError):
        RNGStateful(tracker, fresh).load_state_dict(state)
    assert fresh.seed is None and fresh.step == 0 and fresh.sites == {}


def test_save_and_load_inside_any_fork_over_the_generators_are_refused() -> None:
    """Inside a fork of a CPU tracker the CPU generator holds the stream's state. A save there
    wrote it as the generator's (a resume then replayed the stream on the CPU generator), and a
    load inside another tracker's fork put the saved state into that stream. Both are refused
    now, with nothing written or changed."""
    tracker, keyed = _setup()
    other = RNGStatesTracker("cpu")
    other.add("elsewhere", 21)
    state = RNGStateful(tracker, keyed).state_dict()
    for fork in (tracker.fork("a"), other.fork("elsewhere")):
        with fork:
            before = _live_states(tracker, keyed)
            with pytest.raises(RNGStateSaveError, match=r"inside open fork\(s\) \['"):
                RNGStateful(tracker, keyed).state_dict()
            with pytest.raises(TrackerBusyError, match=r"inside open fork\(s\) \['"):
                RNGStateful(tracker, keyed).load_state_dict(state)
            _assert_unchanged(before, _live_states(tracker, keyed))


def test_a_save_of_two_streams_in_one_state_is_refused_as_every_load_would_be() -> None:
    """A tracker holding two streams of one state (set_states accepted them; now only
    restore_states of a forged snapshot, which puts states back unchecked, gets there): the save
    wrote them, and every load then refused the checkpoint (SeedReuseError)."""
    tracker, keyed = _setup()
    state = tracker.get_states()["a"]
    tracker.restore_states({**tracker.get_states(), "twin": state.clone()})
    with pytest.raises(RNGStateSaveError, match="'a' and tracker stream 'twin' hold the same"):
        RNGStateful(tracker, keyed).state_dict()
    # a CPU state stores its seed but draws from its low 32 bits: another stored seed is no
    # other state (torch.Generator().manual_seed(11 + 2**32) is such a twin of seed 11)
    twin = torch.Generator().manual_seed(11 + 2**32).get_state()
    assert not torch.equal(twin, state) and torch.equal(twin[8:], state[8:])
    tracker.restore_states({"a": state, "b": tracker.get_states()["b"], "twin": twin})
    with pytest.raises(RNGStateSaveError, match="'a' and tracker stream 'twin' hold the same"):
        RNGStateful(tracker, keyed).state_dict()


def test_the_default_tracker_and_keyed_rng_are_the_processs_at_each_call() -> None:
    """An RNGStateful built once (registered with a CheckpointManager, say) kept the tracker of
    its construction; a reseed that replaces the process tracker (Megatron's
    force_reset_rng=True) left it saving and loading a dead one, and the live streams were never
    checkpointed."""
    from rng_tracker import get_keyed_rng, get_rng_tracker
    from rng_tracker import megatron as mg
    from rng_tracker._tracker import _PROCESS_TRACKERS

    before = dict(_PROCESS_TRACKERS)  # this worker's other tests keep their process tracker
    try:
        mg.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
        stateful = RNGStateful()
        mg.model_parallel_cuda_manual_seed(
            1234, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True
        )
        assert stateful.tracker is get_rng_tracker() and stateful.keyed is get_keyed_rng()
        with get_rng_tracker().fork():
            torch.rand(10)
        state = stateful.state_dict()
        with get_rng_tracker().fork():
            expected = torch.rand(3)
            torch.rand(50)
        stateful.load_state_dict(state)
        with get_rng_tracker().fork():
            assert torch.equal(torch.rand(3), expected)
    finally:
        _PROCESS_TRACKERS.clear()
        _PROCESS_TRACKERS.update(before)


class _TwoRNGs:
    """A Stateful holding two RNGStatefuls' entries: a nested one cannot tell which is its own."""

    def __init__(self, first: RNGStateful, second: RNGStateful) -> None:
        self.first, self.second = first, second

    def state_dict(self) -> dict:
        return {"a": self.first.state_dict(), "b": self.second.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.first.load_state_dict(state_dict["a"])
        self.second.load_state_dict(state_dict["b"])


def test_two_rngstatefuls_nested_in_one_stateful_are_refused_at_load(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    tracker, keyed = _setup()
    path = str(tmp_path / "two")
    both = _TwoRNGs(RNGStateful(tracker, keyed), RNGStateful(tracker, keyed))
    dcp.save({"app": both}, checkpoint_id=path, no_dist=True)
    torch.manual_seed(5)
    before = _live_states(tracker, keyed)
    with pytest.raises(StateDictError, match=r"2 places inside 'app' \(app.a, app.b\)"):
        dcp.load({"app": both}, checkpoint_id=path, no_dist=True)
    _assert_unchanged(before, _live_states(tracker, keyed))


def test_options_are_checked_when_built() -> None:
    from rng_tracker.errors import RNGStateConfigError

    for kwargs in ({"saved_by": "rank0"}, {"step": 3}, {"strict": "yes"}):
        with pytest.raises(RNGStateConfigError):
            RNGStateful(**kwargs)
    # strict is checked as every flag is: the refusal shows the value; numpy's bools are bools
    with pytest.raises(RNGStateConfigError, match=r"strict must be a bool, got int 1$"):
        RNGStateful(strict=1)
    assert RNGStateful(strict=np.True_).strict is True


def _live_states(tracker: RNGStatesTracker, keyed: KeyedRNG) -> tuple:
    """The CPU generator, the tracker's streams and the keyed state, bitwise."""
    streams = {name: state.clone() for name, state in tracker.get_states().items()}
    return torch.get_rng_state(), streams, json.dumps(keyed.state_dict(), sort_keys=True)


def _assert_unchanged(before: tuple, after: tuple) -> None:
    assert torch.equal(before[0], after[0])
    assert before[1].keys() == after[1].keys()
    assert all(torch.equal(before[1][name], after[1][name]) for name in before[1])
    assert before[2] == after[2]


_BAD_OPTIONS = [
    ({"layout": {"tp": 2.7}}, "ParallelConfigTypeError", TypeError, r"layout\['tp'\].*float 2\.7"),
    ({"layout": {"tp": True}}, "ParallelConfigTypeError", TypeError, "the bool True"),
    ({"layout": {"tp": "two"}}, "ParallelConfigTypeError", TypeError, "str 'two'"),
    ({"layout": {"tp": None}}, "ParallelConfigTypeError", TypeError, "NoneType None"),
    ({"layout": {2: 2}}, "ParallelConfigTypeError", TypeError, "axis names must be non-empty"),
    ({"layout": {"tp": 0}}, "ParallelConfigError", ValueError, "positive int, got 0"),
    ({"layout": {"tp": -2}}, "ParallelConfigError", ValueError, "positive int, got -2"),
    ({"layout": 5}, "StateDictTypeError", TypeError, "layout must be a str, a mapping"),
    ({"tracker": "x"}, "ArgumentTypeError", TypeError, "tracker must be an RNGStatesTracker"),
    ({"keyed": 5}, "ArgumentTypeError", TypeError, "keyed must be a KeyedRNG"),
]


@pytest.mark.parametrize(("kwargs", "error", "builtin", "match"), _BAD_OPTIONS)
def test_bad_constructor_arguments_are_refused_typed_and_change_nothing(
    kwargs: dict, error: str, builtin: type, match: str
) -> None:
    """A layout size of 2.7 or True was stored as tp=2 or tp=1 (another layout's key), 'two' and
    None raised bare errors, and a tracker or keyed RNG of the wrong type failed only in
    state_dict(): each is refused when built, and nothing changes."""
    from rng_tracker import errors

    tracker, keyed = _setup()
    before = _live_states(tracker, keyed)
    with pytest.raises(getattr(errors, error), match=match) as info:
        RNGStateful(**{"tracker": tracker, "keyed": keyed, **kwargs})
    assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
    _assert_unchanged(before, _live_states(tracker, keyed))


def test_layout_sizes_that_are_ints_keep_their_key() -> None:
    tracker, keyed = _setup()
    for layout in ({"tp": 2, "dp": 2}, {"tp": torch.tensor(2), "dp": 2}, "tp=2,dp=2"):
        assert RNGStateful(tracker, keyed, layout=layout).layout == "tp=2,dp=2"


# --- a layout that looks the same, or gives one rank more along an axis ------------------------


def _seeded(tensor: int, pipeline: int, order: str = "tp-cp-ep-dp-pp"):
    from rng_tracker import model_parallel_seed
    from rng_tracker.parallel import init_model_parallel

    state = init_model_parallel(tensor=tensor, pipeline=pipeline, order=order)
    model_parallel_seed(1234, layout=state)
    return state


def _save_dp4_and_pp2(root: str) -> None:
    import torch.distributed.checkpoint as dcp

    from rng_tracker.parallel import destroy_model_parallel

    _seeded(1, 1)  # dp=4: every generator and stream is equal on all ranks
    dcp.save({"rng": RNGStateful()}, checkpoint_id=os.path.join(root, "dp4"))
    destroy_model_parallel()
    _seeded(1, 2)  # pp=2 x dp=2 in Megatron's default order (dp before pp)
    dcp.save({"rng": RNGStateful()}, checkpoint_id=os.path.join(root, "pp2"))
    destroy_model_parallel()


def _resume_on_tp2pp2_and_reordered(root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from rng_tracker import get_keyed_rng, get_rng_tracker
    from rng_tracker.parallel import destroy_model_parallel, verify_rng_consistency

    out = {}
    cases = {
        "grown": ((2, 2, "tp-cp-ep-dp-pp"), "dp4"),
        "reordered": ((1, 2, "tp-cp-ep-pp-dp"), "pp2"),
    }
    for name, ((tensor, pipeline, order), saved) in cases.items():
        state = _seeded(tensor, pipeline, order)
        path = os.path.join(root, saved)
        before = _states(get_rng_tracker("cpu"), get_keyed_rng("cpu"))
        with pytest.raises(RNGStateLayoutError) as refused:
            dcp.load({"rng": RNGStateful(strict=True)}, checkpoint_id=path)
        unchanged = _states(get_rng_tracker("cpu"), get_keyed_rng("cpu")) == before
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcp.load({"rng": RNGStateful()}, checkpoint_id=path)
        out[name] = {
            "refused": str(refused.value),
            "unchanged": unchanged,
            "warnings": [str(w.message) for w in caught if w.category is RNGStateRederivedWarning],
            "consistent": verify_rng_consistency(state).ok,
        }
        destroy_model_parallel()
    return out


def test_a_grown_axis_or_another_rank_order_is_not_taken_for_the_saved_layout(tmp_path) -> None:
    """Saved at dp=4, every stream is equal on all ranks, model-parallel-rng too (tp=1): resumed
    at tp=2 x pp=2 it must differ across tp, and the default generator across pp, so they are
    re-derived (they were copied to every rank). Saved at pp=2 x dp=2 and resumed with the same
    sizes in Megatron's other order (pp before dp), each rank's entry is another position's
    states, so they are re-derived (each rank took its old entry). strict=True refuses both on
    every rank, changing nothing; re-derived, the states pass verify_rng_consistency."""
    root = str(tmp_path)
    run_distributed(_save_dp4_and_pp2, world_size=4, args=(root,), timeout=240)
    results = run_distributed(
        _resume_on_tp2pp2_and_reordered, world_size=4, args=(root,), timeout=240
    )
    for rank, result in enumerate(results):
        grown, reordered = result["grown"], result["reordered"]
        assert grown["unchanged"] and reordered["unchanged"]
        assert "must differ here" in grown["refused"]
        assert "another rank order" in reordered["refused"]
        (warning,) = grown["warnings"]
        for part in ("the CPU default generator", f"tracker stream {_MP!r}"):
            assert part in warning, (rank, warning)
        assert "'data-parallel-rng'" in warning  # it varies over pp too
        (warning,) = reordered["warnings"]
        assert "another layout (or rank order)" in warning
        assert grown["consistent"] and reordered["consistent"], rank
