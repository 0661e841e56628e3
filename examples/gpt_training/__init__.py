"""gpt_training: the end-to-end training job behind scripts/train.py.

Trainer, corpus, TinyGPT's pipeline split, the job's DCP checkpoints and its errors. This is
the library's worked example, not its API, and ``pip install`` does not install it: the
scripts and tests put ``examples/`` on ``sys.path``. Import the library from ``rng_tracker``
and ``rng_tracker.parallel``.
"""

from __future__ import annotations

__all__: list[str] = []
