"""The integration tests train real models through the frameworks: one intra-op thread each.

With the default (one thread per core) a training step of these tiny models spends most of its
time in threads waiting for each other, ten times longer on a busy two-core machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
