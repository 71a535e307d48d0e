from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from eventbus_debug import EventBus
from eventbus_debug.testing import RecordingSink

BACKEND = os.environ.get("EVENTBUS_DEBUG_TEST_BACKEND", "asyncio")
"""The event loop the async tests run on: asyncio, or trio with
``EVENTBUS_DEBUG_TEST_BACKEND=trio`` (``make test-trio``). In every run, ``tests/test_trio.py``
and ``tests/test_docs.py`` (every README and docs example) run on trio as well."""


@pytest.fixture
def anyio_backend() -> str:
    return BACKEND


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """On trio, skip the tests marked ``asyncio_only`` (they drive asyncio's own loop, tasks
    or scheduling order, or need uvicorn), saying so."""
    if BACKEND == "asyncio":
        return
    for item in items:
        marker = item.get_closest_marker("asyncio_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else "asyncio only"
            item.add_marker(pytest.mark.skip(reason=f"asyncio only: {reason}"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for tiny models (two OpenMP threads only wait for each other, 10x
    slower on 2 busy shared cores); torch's setting is put back after the test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(name="bus")
async def _bus() -> AsyncIterator[EventBus]:
    async with EventBus(close_timeout=5.0) as bus:
        yield bus


@pytest.fixture(name="recorder")
def _recorder() -> RecordingSink:
    return RecordingSink()
