"""The tensor-parallel layers' keywords: ``sequence_parallel`` (Megatron's word), ``sp`` its
deprecated alias for one release."""

from __future__ import annotations

import warnings

import pytest
import torch

from rng_tracker.parallel._layers import RowParallelLinear, shard_param


def test_shard_param_marks_a_sequence_parallel_gradient() -> None:
    full = torch.arange(6.0).view(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new keyword warns nothing
        param = shard_param(full, None, None, sequence_parallel=True)
        plain = shard_param(full, 0, None)
    assert param.sequence_parallel and torch.equal(param, full) and param.tp_shard_dim is None
    assert not plain.sequence_parallel and plain.tp_shard_dim == 0


@pytest.mark.parametrize("value", [True, False])
def test_shard_params_old_sp_keyword_warns_and_still_works(value: bool) -> None:
    with pytest.warns(
        DeprecationWarning, match=r"shard_param\(sp=\.\.\.\) is deprecated.*sequence_parallel"
    ):
        param = shard_param(torch.ones(4), None, None, sp=value)
    assert param.sequence_parallel is value


def test_row_parallel_bias_is_marked_under_sequence_parallelism() -> None:
    layer = RowParallelLinear(4, 2, init=torch.Generator().manual_seed(0), sequence_parallel=True)
    assert layer.bias.sequence_parallel and not layer.weight.sequence_parallel
