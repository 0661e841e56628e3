"""A small generated text corpus and its batches: no downloads, identical on every machine."""

from __future__ import annotations

import random

import torch

from rng_tracker.errors import ParallelConfigError

__all__ = ["Corpus"]

_SUBJECTS = [
    "the tracker",
    "a rank",
    "every stream",
    "the kernel",
    "one mask",
    "a shard",
    "the model",
    "each fork",
]
_VERBS = ["draws", "replays", "forks", "keeps", "saves", "restores", "checks", "seeds"]
_OBJECTS = [
    "the same mask",
    "a fresh key",
    "its counter",
    "the dropout",
    "every state",
    "the logical tensor",
]
_ENDS = [".", "!", " again.", " on every rank.", " in backward."]


class Corpus:
    """Character-level text from a fixed grammar; a step's global batch depends on the step alone."""

    def __init__(self, *, vocab: int = 64, chars: int = 200_000, seed: int = 0) -> None:
        rng = random.Random(seed)
        parts, length = [], 0
        while length < chars:
            parts.append(
                f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDS)} "
            )
            length += len(parts[-1])
        text = "".join(parts)[:chars]
        alphabet = sorted(set(text))
        if len(alphabet) > vocab:
            raise ParallelConfigError(
                f"the corpus has {len(alphabet)} symbols, more than vocab={vocab}"
            )
        self.alphabet = alphabet
        lookup = torch.zeros(256, dtype=torch.int64)  # the grammar is ASCII: byte -> token id
        lookup[[ord(ch) for ch in alphabet]] = torch.arange(len(alphabet))
        self.tokens = lookup[
            torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()
        ]

    def global_batch(
        self, step: int, *, batch: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch, seq_len): the whole global batch of ``step``.

        A pure function of (step, batch, seq_len), so which samples a step sees, and in which
        order, does not depend on the parallel layout; ranks and microbatches take slices.
        """
        if batch < 1 or seq_len < 1 or seq_len + 1 > self.tokens.numel():
            raise ParallelConfigError(
                f"batch={batch} and seq_len={seq_len} must be positive and seq_len below "
                f"the corpus length {self.tokens.numel()}"
            )
        rng = torch.Generator().manual_seed(1_000_003 * step + 7919)
        starts = torch.randint(0, self.tokens.numel() - seq_len - 1, (batch,), generator=rng)
        rows = torch.stack([self.tokens[s : s + seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]  # (batch, seq_len) each
