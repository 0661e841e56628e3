"""The process mesh over torch.distributed: ranks, sizes and groups per axis, clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rng_tracker import ParallelStateError, RNGTrackerError
from rng_tracker.errors import ParallelConfigError
from rng_tracker.parallel import destroy_model_parallel, get_parallel_state, init_model_parallel


def test_get_parallel_state_before_init_is_a_typed_error():
    with pytest.raises(ParallelStateError, match="init_model_parallel"):
        get_parallel_state()


@pytest.mark.distributed(world_size=4, timeout=90)
def test_mesh_layout_groups_and_errors(rank):
    """tp is fastest-varying; each axis' group holds exactly the ranks differing on that axis."""
    destroy_model_parallel()
    with pytest.raises(ParallelConfigError, match="not divisible"):
        init_model_parallel(tensor=3)
    with pytest.raises(ParallelConfigError, match="positive int"):
        init_model_parallel(tensor=0)
    state = init_model_parallel(tensor=2, expert=2)
    assert get_parallel_state() is state
    assert (
        state.size("tp"),
        state.size("dp"),
        state.size("pp"),
        state.size("ep"),
        state.size("etp"),
    ) == (2, 2, 1, 2, 2)
    assert (state.rank("tp"), state.rank("dp")) == (rank % 2, rank // 2)
    assert state.rank("ep") == rank // 2 and state.rank("etp") == rank % 2
    for axis, members in {
        "tp": [rank - rank % 2, rank - rank % 2 + 1],
        "dp": [rank % 2, rank % 2 + 2],
    }.items():
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=state.group(axis))
        assert value.item() == float(sum(members)), axis
    with pytest.raises(ParallelStateError, match="already initialised") as info:
        init_model_parallel(tensor=2)
    assert isinstance(info.value, RNGTrackerError)
    destroy_model_parallel()


def test_global_rank_places_a_layout_by_megatrons_order_without_a_mesh():
    """tp varies fastest in the default order; 'tp-cp-ep-pp-dp' puts pp before dp; every
    coordinate of the layout gets its own rank; bad axes and coordinates are typed errors."""
    from rng_tracker.errors import ParallelConfigError
    from rng_tracker.parallel._mesh import global_rank

    sizes = {"tp": 2, "dp": 2, "pp": 2}
    cells = [{"tp": t, "dp": d, "pp": p} for p in range(2) for d in range(2) for t in range(2)]
    assert [global_rank(c, sizes) for c in cells] == list(range(8))
    assert global_rank({"pp": 1}, sizes, order="tp-cp-ep-pp-dp") == 2
    assert global_rank({"dp": 1}, sizes, order="tp-cp-ep-pp-dp") == 4
    with pytest.raises(ParallelConfigError, match="dense axes"):
        global_rank({"ep": 1}, sizes)
    with pytest.raises(ParallelConfigError, match="outside an axis of size 2"):
        global_rank({"tp": 2}, sizes)


@pytest.mark.distributed(world_size=1, timeout=90)
def test_unknown_device_types_are_refused_before_the_mesh_is_built(rank):
    """device_type='bogus' was accepted and built a mesh of a device torch does not know."""
    from rng_tracker.errors import ParallelConfigTypeError
    from rng_tracker.parallel._mesh import get_parallel_state_or_none

    destroy_model_parallel()
    before = torch.get_rng_state()
    cases = [
        ("bogus", ParallelConfigError, ValueError, "'bogus' is not a torch device type"),
        ("cuda:0", ParallelConfigError, ValueError, "'cuda:0' is not a torch device type"),
        ("CPU", ParallelConfigError, ValueError, "'CPU' is not a torch device type"),
        (5, ParallelConfigTypeError, TypeError, "device_type must be a str.*int 5"),
        (True, ParallelConfigTypeError, TypeError, "device_type must be a str.*bool True"),
    ]
    for device_type, error, builtin, match in cases:
        with pytest.raises(error, match=match) as info:
            init_model_parallel(device_type=device_type)
        assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, builtin)
        assert get_parallel_state_or_none() is None
        assert torch.equal(torch.get_rng_state(), before)
    assert init_model_parallel(device_type="cpu").mesh.device_type == "cpu"
    destroy_model_parallel()


@pytest.mark.distributed(world_size=1, timeout=90)
def test_an_order_that_is_not_a_str_is_a_type_error(rank):
    """order=5 (or None, or a list of tokens) raised a ValueError that is no TypeError, unlike
    every other argument of the wrong type."""
    from rng_tracker.errors import ParallelConfigTypeError
    from rng_tracker.parallel._mesh import get_parallel_state_or_none

    destroy_model_parallel()
    for order in (5, None, ["tp", "dp"]):
        with pytest.raises(ParallelConfigTypeError, match="order must be a str") as info:
            init_model_parallel(order=order)
        assert isinstance(info.value, ParallelConfigError) and isinstance(info.value, TypeError)
        assert get_parallel_state_or_none() is None


@pytest.mark.parametrize("method", ["rank", "size", "group"])
def test_an_unknown_axis_is_a_key_error_and_a_parallel_state_error(method):
    """state.rank("tpx") raised a ParallelStateError that was only a RuntimeError, while every
    other unknown name of the library (a stream, a coordinate axis) is a KeyError too."""
    from rng_tracker.errors import UnknownAxisError
    from rng_tracker.parallel import ParallelState
    from rng_tracker.parallel._megatron_state import MegatronParallelState

    axes = ("tp", "pp", "dp", "cp", "ep", "etp", "edp")
    ours = ParallelState(mesh=None, expert_mesh=None, sizes={}, ranks={})  # type: ignore[arg-type]
    theirs = MegatronParallelState(
        sizes=dict.fromkeys(axes, 1), ranks=dict.fromkeys(axes, 0), groups={}
    )
    before = torch.get_rng_state()
    for state in (ours, theirs):
        for axis in ("tpx", None, "TP"):
            with pytest.raises(UnknownAxisError) as info:
                getattr(state, method)(axis)
            error = info.value
            assert isinstance(error, ParallelStateError) and isinstance(error, KeyError)
            assert isinstance(error, RNGTrackerError)
            message = str(error)  # the message itself, not KeyError's repr of it
            assert message.startswith(f"unknown parallel axis {axis!r}; use one of ")
            assert all(repr(name) in message for name in axes), message
    assert torch.equal(torch.get_rng_state(), before)


def test_checking_a_device_type_does_not_start_the_device(monkeypatch):
    """The check of device_type asked for the device's current_device(), which initialises CUDA
    before DeviceMesh runs, and DeviceMesh moves each rank to its own GPU only when CUDA is not
    initialised yet: every rank of a node stayed on cuda:0. The check now reads only whether
    such a device is available (here a CUDA module made to say so, as no GPU is here; on a GPU,
    tests/test_cuda.py checks that CUDA stays uninitialised)."""
    from rng_tracker.parallel._mesh import _check_device_type

    def started() -> int:
        raise AssertionError("the check started the device (current_device)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", started)
    _check_device_type("cuda")


@pytest.mark.distributed(world_size=1, timeout=90)
def test_a_device_type_without_a_generator_here_is_refused(rank):
    """device_type="meta" built a mesh (and process groups) of a device that holds no data,
    has no generator and runs no collective; so did "cuda" on a machine without one."""
    from rng_tracker.parallel._mesh import get_parallel_state_or_none

    destroy_model_parallel()
    before = torch.get_rng_state()
    refused = ["meta", "lazy", "mtia"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device_type in refused:
        with pytest.raises(ParallelConfigError, match=f"device_type {device_type!r}") as info:
            init_model_parallel(device_type=device_type)
        assert isinstance(info.value, RNGTrackerError) and isinstance(info.value, ValueError)
        assert "no usable" in str(info.value) and "'cpu'" in str(info.value)
        assert get_parallel_state_or_none() is None
        assert torch.equal(torch.get_rng_state(), before)
    for device_type in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        assert init_model_parallel(device_type=device_type).mesh.device_type == device_type
        destroy_model_parallel()
    assert torch.equal(torch.get_rng_state(), before)
