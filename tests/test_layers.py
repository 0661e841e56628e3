"""The tensor-parallel layers' keywords: ``sequence_parallel`` (Megatron's word), ``sp`` its
deprecated alias for one release."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from rng_tracker.parallel._layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_param,
)
from rng_tracker.parallel.transformer import TinyGPT


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


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


_BAD_CONFIGS = [
    ({"heads": 0}, "ParallelConfigError", ValueError, "GPTConfig.heads must be a positive int"),
    ({"heads": 3}, "ParallelConfigError", ValueError, "heads=3 must divide hidden=64"),
    ({"vocab": -4}, "ParallelConfigError", ValueError, "GPTConfig.vocab must be a positive int"),
    ({"layers": 2.5}, "ParallelConfigTypeError", TypeError, "GPTConfig.layers must be an int"),
    ({"seq_len": True}, "ParallelConfigTypeError", TypeError, "the bool True"),
    ({"hidden_dropout": 1.5}, "ParallelConfigError", ValueError, r"in \[0, 1\], got 1.5"),
    ({"attention_dropout": float("nan")}, "ParallelConfigError", ValueError, "got nan"),
    ({"embedding_dropout": "0.1"}, "ParallelConfigTypeError", TypeError, "got str '0.1'"),
    ({"embedding_dropout": True}, "ParallelConfigTypeError", TypeError, "got bool True"),
    ({"sequence_parallel": "yes"}, "ParallelConfigTypeError", TypeError, "must be a bool"),
    ({"init_seed": 2**64}, "InvalidSeedError", ValueError, r"init_seed must be in \[0, 2\*\*64\)"),
    ({"init_seed": -1}, "InvalidSeedError", ValueError, r"init_seed must be in \[0, 2\*\*64\)"),
    ({"init_seed": 1.0}, "InvalidSeedTypeError", TypeError, "init_seed must be an int"),
]


@pytest.mark.parametrize(("kwargs", "error", "builtin", "match"), _BAD_CONFIGS)
def test_gpt_config_refuses_bad_sizes_probabilities_and_seeds(kwargs, error, builtin, match):
    """heads=0 was a ZeroDivisionError in TinyGPT, dropout 1.5 and nan were accepted, vocab=-4
    and init_seed=2**64 raised bare errors while building the model."""
    from rng_tracker import errors
    from rng_tracker.parallel.transformer import GPTConfig

    before = torch.get_rng_state()
    with pytest.raises(getattr(errors, error), match=match) as info:
        GPTConfig(**kwargs)
    assert isinstance(info.value, errors.RNGTrackerError) and isinstance(info.value, builtin)
    assert torch.equal(torch.get_rng_state(), before)


_BAD_LAYERS = [
    (
        lambda init: ColumnParallelLinear(-3, 4, init=init),
        "ParallelConfigError",
        ValueError,
        "in_features must be a positive int, got -3",
    ),
    (
        lambda init: RowParallelLinear(4.5, 4, init=init),
        "ParallelConfigTypeError",
        TypeError,
        "in_features must be an int, got float 4.5",
    ),
    (
        lambda init: RowParallelLinear(4, 0, init=init),
        "ParallelConfigError",
        ValueError,
        "out_features must be a positive int, got 0",
    ),
    (
        lambda init: VocabParallelEmbedding(0, 4, init=init),
        "ParallelConfigError",
        ValueError,
        "vocab must be a positive int, got 0",
    ),
    (
        lambda init: VocabParallelEmbedding(8, True, init=init),
        "ParallelConfigTypeError",
        TypeError,
        "hidden must be an int, got the bool True",
    ),
    (
        lambda init: ColumnParallelLinear(4, 4, init="g"),
        "ArgumentTypeError",
        TypeError,
        "init must be the torch.Generator",
    ),
    (
        lambda init: ColumnParallelLinear(4, 4, init=init, gather_output="yes"),
        "ArgumentTypeError",
        TypeError,
        "gather_output must be a bool",
    ),
    (
        lambda init: RowParallelLinear(4, 4, init=init, skip_bias_add=1),
        "ArgumentTypeError",
        TypeError,
        "skip_bias_add must be a bool, got int 1",
    ),
    (
        lambda init: TinyGPT({"vocab": 8}),
        "ArgumentTypeError",
        TypeError,
        "config must be a GPTConfig, got dict",
    ),
]


@pytest.mark.parametrize(("build", "error", "builtin", "match"), _BAD_LAYERS)
def test_layers_refuse_bad_sizes_before_drawing_their_weights(build, error, builtin, match):
    """ColumnParallelLinear(-3, 4) was a "math domain error"; VocabParallelEmbedding(0, ...) was
    accepted. Each is typed now, and ``init`` has drawn nothing."""
    from rng_tracker import errors

    init = _gen()
    before, cpu = init.get_state(), torch.get_rng_state()
    with pytest.raises(getattr(errors, error), match=match) as info:
        build(init)
    assert isinstance(info.value, errors.RNGTrackerError) and isinstance(info.value, builtin)
    assert torch.equal(init.get_state(), before) and torch.equal(torch.get_rng_state(), cpu)


def test_valid_configs_and_layers_build_the_same_weights() -> None:
    from rng_tracker.parallel.transformer import GPTConfig

    config = GPTConfig(hidden=16, heads=2, ffn=32, seq_len=8, init_seed=2**64 - 1)
    assert TinyGPT(config).config is config
    assert GPTConfig(hidden_dropout=0, attention_dropout=1).hidden_dropout == 0
    layer = ColumnParallelLinear(3, 4, init=_gen())
    bound = 1 / 3**0.5
    assert torch.equal(layer.weight, torch.empty(4, 3).uniform_(-bound, bound, generator=_gen()))


def test_an_embedding_without_tp_refuses_ids_outside_its_vocabulary() -> None:
    """Without TP every id must be a row: ids 8, 100 and -1 of an 8-word vocabulary raise, as
    F.embedding and Megatron at TP=1 do (they were looked up as zero vectors)."""
    embedding = VocabParallelEmbedding(8, 4, init=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[0, 7, 3]])
    assert torch.equal(embedding(tokens), F.embedding(tokens, embedding.weight))
    for bad in (8, 100, -1):
        with pytest.raises(IndexError):
            embedding(torch.tensor([[0, bad]]))
