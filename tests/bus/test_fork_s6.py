"""A bus used from a forked child process (a DataLoader worker) counts what it cannot deliver.

A fork copies the bus, not its event loop: an event published in the child cannot reach it.
Publishing there never raises (a dataset that reports something must not stop the training):
the events are counted in ``lost_in_fork`` and the first one is logged once, naming the cause
and the way out. The parent's bus is unaffected, and the library's own worker-side code
(SkipCorruptSamples, CorruptSampleCollate) keeps working with workers.
"""

from __future__ import annotations

import logging
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

FORK_MESSAGE = r"forked from it \(a DataLoader worker\?\).*they are lost"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _Publishes(Dataset[str]):
    """Each sample publishes twice on *bus* and says, from its process, what the bus counted
    and what the library's logger said."""

    def __init__(self, bus: Any, inner: Any) -> None:
        self.bus = bus
        self.inner = inner  # the EventBus (a SyncEventBus's underlying one)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> str:
        records = _Records()
        logger = logging.getLogger("eventbus_debug")
        logger.addHandler(records)
        try:
            for _ in range(2):
                self.bus.publish_nowait(StepCompleted(step=index))
        except BusClosedError as exc:  # pragma: no cover - the old behaviour
            return f"{os.getpid()}: raised {exc}"
        finally:
            logger.removeHandler(records)
        return f"{os.getpid()}: {self.inner.lost_in_fork}: {' | '.join(records.messages)}"


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
            dataset = _Publishes(bus, bus.bus)
            answers = [a for batch in _loader(dataset, collate_fn=_keep) for a in batch]
            bus.publish(StepCompleted(step=99))  # the parent's bus still works
            bus.drain(timeout=30)
            assert bus.statistics().published == 1
            assert bus.bus.lost_in_fork == 0  # counted in the children only
        _check_answers(answers)

    async def test_async_bus(self) -> None:
        recorder = RecordingSink()
        async with EventBus() as bus:
            bus.subscribe(recorder)
            dataset = _Publishes(bus, bus)
            answers = [a for batch in _loader(dataset, collate_fn=_keep) for a in batch]
            bus.publish_nowait(StepCompleted(step=99))
            await bus.drain(timeout=30)
        assert [e.step for e in recorder.events] == [99]
        _check_answers(answers)

    def test_a_closed_bus_still_raises_in_the_parent(self) -> None:
        bus = EventBus()
        with pytest.raises(BusClosedError, match="not running yet"):
            bus.publish_nowait(StepCompleted(step=0))
        assert bus.lost_in_fork == 0


def _check_answers(answers: list[str]) -> None:
    """Every sample ran in a worker, never raised, and its worker counted and logged once."""
    assert len(answers) == 4
    parent = str(os.getpid())
    by_worker: dict[str, list[tuple[int, str]]] = {}
    for answer in answers:
        pid, lost, said = answer.split(": ", 2)
        assert pid != parent
        by_worker.setdefault(pid, []).append((int(lost), said))
    for seen in by_worker.values():
        # each worker's first sample logged the warning once; its count grows by 2 a sample
        first = min(seen)
        assert first[0] == 2
        assert "events_lost_in_forked_child" in first[1]
        assert f"runs in process {parent}" in first[1]
        assert re.search(FORK_MESSAGE, first[1])
        assert sorted(n for n, _ in seen) == [2 * (i + 1) for i in range(len(seen))]
        assert all(not said for n, said in seen if n != 2)


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
