"""A sink that writes the run to TensorBoard: scalars per step, incidents as text.

Needs the optional ``tensorboard`` extra (``pip install -e ".[tensorboard]"``); TensorBoard
is imported when the sink is built, never when :mod:`sinks` is imported. Writes go through
:class:`torch.utils.tensorboard.SummaryWriter` in a worker thread, once per batch the bus hands
over, so the event loop never waits for the disk.

What is written (see :mod:`sinks._metrics` for every tag): loss, learning rate, throughput and
step time (``train/*``), the total gradient and parameter norms (``check/*``), per-parameter
gradient norms and update ratios at ADVANCED level and above (``layers/*``), memory and system
samples, and per incident a marker scalar ``incidents/<kind>`` plus a text entry under
``incidents`` at its step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eventbus_debug.events import Event
from eventbus_debug.threads import DaemonWorker

from ._checks import seconds
from ._metrics import Note, Point, StepClock, metrics_of

__all__ = ("TensorBoardSink",)


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        msg = (
            "TensorBoardSink needs the tensorboard package, the optional 'tensorboard' extra: "
            "pip install -e '.[tensorboard]'"
        )
        raise ImportError(msg) from None
    return SummaryWriter


class TensorBoardSink:
    """Write scalars and incidents of the run as TensorBoard event files under *log_dir*.

    Args:
        log_dir: the TensorBoard run directory (created when missing).
        per_layer: write per-parameter gradient norms and update ratios when the probe
            publishes them (ADVANCED level and above).
        flush_secs: how often TensorBoard's writer flushes on its own (the sink also flushes
            after every batch it writes and at close).
        name: the subscription name the bus uses.

    Raises:
        ImportError: if tensorboard is not installed (the message says how to install it).
        TypeError: if *log_dir* is not a path.
        ArgumentTypeError: if *flush_secs* is not a number (a ``TypeError``, and the
            ``ValueError`` earlier releases raised).
        ValueError: if *flush_secs* is not a finite number > 0.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        per_layer: bool = True,
        flush_secs: float = 10.0,
        name: str = "tensorboard",
    ) -> None:
        if not isinstance(log_dir, (str, os.PathLike)):
            msg = f"log_dir must be a path, got {log_dir!r}"
            raise TypeError(msg)
        flush_secs = seconds("flush_secs", flush_secs, rule="a positive number of seconds (finite)")
        self._writer_class = _summary_writer()
        self.log_dir = Path(log_dir)
        self.name = name
        self._per_layer = per_layer
        self._flush_secs = flush_secs
        self._writer: Any = None
        self._clock = StepClock()
        self._closed = False
        # Writes run in a daemon thread of the sink's: a write that hangs can be abandoned by
        # the bus's close bound on every backend (on trio the bus joins the sink's task, so an
        # uncancellable wait on anyio's worker would hold the close) and never keeps the
        # process alive at exit.
        self._worker = DaemonWorker(f"eventbus-tensorboard-{name}")
        self.written = 0
        """Scalars and text entries written so far."""

    @property
    def thread_busy(self) -> bool:
        """Whether the sink's thread is inside a write now (one that hangs keeps it busy)."""
        return self._worker.busy

    def __repr__(self) -> str:
        return f"<TensorBoardSink log_dir={str(self.log_dir)!r}>"

    async def handle(self, event: Event, /) -> None:
        """Write one event (the bus prefers :meth:`handle_batch`)."""
        await self.handle_batch((event,))

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        """Turn *events* into scalars and notes here, write them in a worker thread.

        Raises:
            RuntimeError: if the sink is closed.
            OSError: if the event file cannot be written (the bus reports ``SinkFailed``).
        """
        if self._closed:
            msg = f"{self!r} is closed"
            raise RuntimeError(msg)
        points, notes = metrics_of(events, self._clock, per_layer=self._per_layer)
        if points or notes:
            await self._worker.run(self._write, points, notes)

    async def aclose(self) -> None:
        """Flush and close the event file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                # Abandoned, not waited for, past the close's bound: it completes in the thread.
                await self._worker.run(writer.close)
        finally:
            self._worker.stop()

    def _write(self, points: list[Point], notes: list[Note]) -> None:
        writer = self._writer
        if writer is None:
            writer = self._writer = self._writer_class(
                log_dir=str(self.log_dir), flush_secs=self._flush_secs
            )
        for p in points:
            writer.add_scalar(p.tag, p.value, global_step=p.step, walltime=p.wall_time)
        for n in notes:
            rank = f" (rank {n.rank})" if n.rank else ""
            writer.add_text(
                "incidents",
                f"**{n.severity.value.upper()}** `{n.kind}`{rank}: {n.text}",
                global_step=n.step,
                walltime=n.wall_time,
            )
        writer.flush()
        self.written += len(points) + len(notes)
