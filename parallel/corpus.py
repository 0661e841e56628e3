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
    """Character-level text from a fixed grammar; batches are a pure function of (step, dp rank)."""

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

    def batch(
        self, step: int, dp_rank: int, dp_size: int, *, batch: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch, seq_len), for one data-parallel rank at ``step``."""
        rng = torch.Generator().manual_seed(1_000_003 * step + dp_rank * 7919 + dp_size)
        starts = torch.randint(0, self.tokens.numel() - seq_len - 1, (batch,), generator=rng)
        rows = torch.stack([self.tokens[s : s + seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]
