from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch

from eventbus_debug import EventBus
from eventbus_debug.testing import RecordingSink


@pytest.fixture
def anyio_backend() -> str:
    # aiofiles and the torch-facing code are asyncio-only.
    return "asyncio"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(name="bus")
async def _bus() -> AsyncIterator[EventBus]:
    async with EventBus(close_timeout=5.0) as bus:
        yield bus


@pytest.fixture(name="recorder")
def _recorder() -> RecordingSink:
    return RecordingSink()
