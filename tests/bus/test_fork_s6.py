"""A bus used from a forked child process (a DataLoader worker) refuses to publish, saying why.

A fork copies the bus, not its event loop: an event published in the child would vanish.
Publishing there raises a BusClosedError that names the cause and the way out; the parent's
bus is unaffected, and the library's own worker-side code (SkipCorruptSamples,
CorruptSampleCollate) keeps working with workers.
"""

from __future__ import annotations

import multiprocessing
import os
import re
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from eventbus_debug import BusClosedError, EventBus, SyncEventBus
from eventbus_debug.events import SampleSkipped, StepCompleted
from eventbus_debug.recovery import skip_corrupt_samples
from eventbus_debug.testing import RecordingSink

pytestmark = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs fork (POSIX)"
)

FORK_MESSAGE = r"forked from it \(a DataLoader worker\?\).*Publish from the training process"


class _Publishes(Dataset[str]):
    """Each sample publishes on *bus* and says what happened, and in which process."""

    def __init__(self, bus: Any) -> None:
        self.bus = bus

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> str:
        try:
            self.bus.publish_nowait(StepCompleted(step=index))
        except BusClosedError as exc:
            return f"{os.getpid()}: {exc}"
        return f"{os.getpid()}: published"


def _keep(batch: list[str]) -> list[str]:
    return batch


def _loader(dataset: Dataset[Any], **kwargs: Any) -> DataLoader[Any]:
    return DataLoader(
        dataset, batch_size=2, num_workers=2, multiprocessing_context="fork", **kwargs
    )


class _Flaky(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index in (3, 11):
            msg = f"cannot decode sample {index}"
            raise ValueError(msg)
        return torch.zeros(2), torch.zeros(1)


class TestPublishingFromAWorker:
    def test_sync_bus(self) -> None:
        with SyncEventBus() as bus:
            answers = [a for batch in _loader(_Publishes(bus), collate_fn=_keep) for a in batch]
            bus.publish(StepCompleted(step=99))  # the parent's bus still works
            bus.drain(timeout=30)
            assert bus.statistics().published == 1
        assert len(answers) == 4
        parent = str(os.getpid())
        for answer in answers:
            pid, _, message = answer.partition(": ")
            assert pid != parent
            assert f"runs in process {parent}" in message
            assert re.search(FORK_MESSAGE, message)

    async def test_async_bus(self) -> None:
        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder)
            answers = [a for batch in _loader(_Publishes(bus), collate_fn=_keep) for a in batch]
            bus.publish_nowait(StepCompleted(step=99))
            await bus.drain(timeout=30)
        assert [e.step for e in recorder.events] == [99]
        assert all("forked from it" in a for a in answers)


class TestTheLibrarysWorkerSideCode:
    async def test_skip_corrupt_samples_with_workers_on_an_async_bus(self) -> None:
        """The markers cross the workers; the loader publishes in the training process."""
        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder, SampleSkipped)
            loader = skip_corrupt_samples(
                _Flaky(), bus, batch_size=4, num_workers=2, multiprocessing_context="fork"
            )
            assert sum(len(x) for x, _ in loader) == 14
            await bus.drain(timeout=30)
        assert sorted(s.index for s in recorder.of_type(SampleSkipped)) == [3, 11]
