"""The integration tests train real models through the frameworks: one intra-op thread each.

With the default (one thread per core) a training step of these tiny models spends most of its
time in threads waiting for each other, ten times longer on a busy two-core machine.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every integration test trains a tiny model on one torch thread (tests/conftest.py)."""
