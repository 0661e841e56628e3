"""rng_tracker.parallel.demo: the end-to-end training job behind scripts/train.py.

Trainer, corpus, TinyGPT's pipeline split and the job's DCP checkpoints. This is the
library's worked example, not its API: import the library from ``rng_tracker`` and
``rng_tracker.parallel``.
"""

from __future__ import annotations

__all__: list[str] = []
