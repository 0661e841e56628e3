"""megatron-core 0.19.2's own GPTModel, routed to rng_tracker with one line, on 2 gloo CPU ranks.

Everything below is Megatron's code (local layer spec, TP=2, dropout 0.1, Megatron's
parallel_state) except ``rng_tracker.megatron.install()``. Claims: every recompute mode gives
gradients bitwise equal to no recompute, selective ``mlp`` with Megatron's default biases
included (it hung before); dropout masks differ across TP ranks where the activations are
sharded and are identical where they are replicated; a second run with the same seed is
bitwise equal. Sequence parallel too, with all of that (hidden-state masks then differ across TP
ranks: Megatron forks its whole block under SP): megatron-core 0.19.2's local spec refuses SP
only in its torch LayerNorm wrapper ("sequence parallel not supported by torch LayerNorm",
asserted below so that a megatron-core that allows it shows up), so the SP runs swap that one
class in Megatron's spec for a torch LayerNorm that marks its parameters ``sequence_parallel``
as Megatron's Apex/TE norms do, and let Megatron's SP collectives, which allocate on
``torch.cuda.current_device()``, allocate on the CPU. Reproduce with
``bash scripts/test.sh tests/test_megatron_core_model.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _megatron_cpu import CPU_ONLY_CONFIG, cuda_means_cpu, sequence_parallel_spec
from torch.overrides import TorchFunctionMode

_SEQ, _BATCH, _VOCAB = 16, 2, 64

_RECOMPUTE = {
    "full/uniform": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "full/block": {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 2,
    },
    "selective core_attn": {
        "recompute_granularity": "selective",
        "recompute_modules": ["core_attn"],
    },
    "selective mlp, with biases": {
        "recompute_granularity": "selective",
        "recompute_modules": ["mlp"],
        "add_bias_linear": True,
    },
    "selective layernorm": {
        "recompute_granularity": "selective",
        "recompute_modules": ["layernorm"],
    },
}


class _DropoutMasks(TorchFunctionMode):
    """Records the keep-mask of every ``F.dropout`` call, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.dropout:
            self.masks.append((out != 0).detach().clone())
        return out


def _run(
    spec: Any = None, **config: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[torch.Tensor]]:
    """Build Megatron's GPTModel (seeded by Megatron's own call), run one forward and
    backward; return the loss, the gradients and the dropout masks of the forward."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        tensor_model_parallel_size=2,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        use_cpu_initialization=True,  # CPU: no CUDA initialisation
        **CPU_ONLY_CONFIG,
        **config,
    )
    spec = get_gpt_layer_local_spec() if spec is None else spec
    model = GPTModel(cfg, spec, vocab_size=_VOCAB, max_sequence_length=_SEQ)
    data = torch.Generator().manual_seed(5)
    ids = torch.randint(0, _VOCAB, (_BATCH, _SEQ), generator=data)
    positions = torch.arange(_SEQ).expand(_BATCH, _SEQ)
    causal = torch.ones(1, 1, _SEQ, _SEQ).tril() < 0.5
    recorder = _DropoutMasks()
    with recorder:
        loss = model(ids, positions, causal, labels=ids)
        (loss * torch.linspace(0.5, 1.5, _SEQ)).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, recorder.masks


def _bitwise(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (
        torch.equal(a[0], b[0])
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    )


def _same_on_both_tp_ranks(mask: torch.Tensor) -> bool:
    other = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(2)]
    dist.all_gather(other, mask.to(torch.uint8))
    return torch.equal(other[0], other[1])


@pytest.mark.distributed(world_size=2, timeout=240)
def test_megatron_gpt_model_with_one_line_install(rank):
    warnings.simplefilter("ignore")  # Megatron's warnings about TE/Apex and deprecations
    import rng_tracker.megatron

    rng_tracker.megatron.install()  # the one line

    import megatron.core.parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    # Megatron allocates attention's scratch buffer on torch.cuda.current_device(); on CPU
    # it gets a CPU buffer once (the only CPU accommodation besides the fusions above).
    ps.get_global_memory_buffer().buffer[("mpu", torch.float32)] = torch.empty(1 << 16)

    base = _run()
    assert _bitwise(base, _run()), "a second run with the same seed differs"
    masks = base[2]
    attention = [m for m in masks if m.dim() == 4]  # [b, heads/tp, s, s]: sharded over TP
    hidden = [m for m in masks if m.dim() == 3]  # [s, b, h]: replicated over TP
    # embedding dropout, then per layer the two bias-dropout-adds and one attention dropout
    assert len(attention) == 2 and len(hidden) == 5, [m.shape for m in masks]
    assert not any(_same_on_both_tp_ranks(m) for m in attention)
    assert all(_same_on_both_tp_ranks(m) for m in hidden)

    for name, config in _RECOMPUTE.items():
        assert _bitwise(base, _run(**config)), name

    with pytest.raises(AssertionError, match="sequence parallel not supported by torch LayerNorm"):
        _run(sequence_parallel=True)
    # Megatron's sequence-parallel all-gather and reduce-scatter allocate their outputs on
    # torch.cuda.current_device(); on a CPU-only build that call asserts, so for this part
    # "the current CUDA device" is the CPU (rng_tracker never calls it: it asks
    # torch.cuda.is_available() first).
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    sp_spec = sequence_parallel_spec(get_gpt_layer_local_spec(), num_layers=2)
    with cuda_means_cpu():
        sp_base = _run(sp_spec, sequence_parallel=True)
        assert _bitwise(sp_base, _run(sp_spec, sequence_parallel=True)), "SP: a second run differs"
        sp_hidden = [m for m in sp_base[2] if m.dim() == 3]  # [s/tp, b, h]: sharded over TP
        # as without SP: embedding dropout, then two bias-dropout-adds per layer
        assert len(sp_hidden) == 5, [m.shape for m in sp_base[2]]
        assert all(m.shape[0] == _SEQ // 2 for m in sp_hidden), [m.shape for m in sp_hidden]
        assert not any(_same_on_both_tp_ranks(m) for m in sp_hidden)
        for name, config in _RECOMPUTE.items():
            assert _bitwise(sp_base, _run(sp_spec, sequence_parallel=True, **config)), f"SP, {name}"
