"""Shared fixtures: a private CPU tracker and a clean global generator per test."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through Triton's interpreter; this must be set
    # before rng_tracker.kernels is first imported (triton.jit reads it at decoration).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The training job (gpt_training) lives in examples/, which pip does not install.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from rng_tracker import RNGStatesTracker
from rng_tracker.parallel.testing import preload_modules

# What the suite's ranks import, imported once per pytest process instead of once per rank (the
# suite took 14.5 min on 2 cores without it, 8.5 with it). scripts/test.sh installs the frameworks.
preload_modules(
    "rng_tracker.kernels",
    "rng_tracker.parallel",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "megatron.core",
    "torchtitan.models.llama3",
)

pytest_plugins = ["pytester"]


@pytest.fixture
def tracker() -> RNGStatesTracker:
    """A tracker of the CPU that no other test shares."""
    return RNGStatesTracker("cpu")


@pytest.fixture(autouse=True)
def _restore_cpu_generator() -> Iterator[None]:
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


@pytest.fixture(autouse=True)
def _restore_torch_debug_logger() -> Iterator[None]:
    """torch's checkpoint debug mode leaves its "LoggingTensor" logger with propagate off, level
    INFO and its traceback filters; pytest then attaches its capture handlers to that logger in
    every later test, and they cannot format torch's records: a later debug-mode checkpoint
    fails inside logging. Each test leaves the logger as it found it."""
    logger = logging.getLogger("LoggingTensor")
    saved = (logger.propagate, logger.level, logger.filters[:])
    yield
    logger.propagate, logger.level, logger.filters[:] = saved[0], saved[1], saved[2]
