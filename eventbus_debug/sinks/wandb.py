"""A sink that sends the run to Weights & Biases: ``run.log`` for scalars, ``run.alert`` for incidents.

Needs the optional ``wandb`` extra (``pip install -e ".[wandb]"``); wandb is imported when the
sink is built, never when :mod:`sinks` is imported. Give it your run (``WandbSink(run)``), or
let it start one (``WandbSink(project="...", mode="offline")``: the keyword arguments go to
``wandb.init``), which it then finishes at close.

Scalars carry the same tags as the TensorBoard sink (see :mod:`sinks._metrics`) and are logged
against a ``step`` metric of their own (``define_metric``), so events arriving out of step
order are never dropped by wandb. Incidents become W&B alerts (email / Slack, per your W&B
settings) with a cooldown like the alert rules': the first of a kind (per rank) at once,
repeats within ``alert_cooldown`` seconds counted and reported with the next alert. Every write
runs in a worker thread, once per batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from eventbus_debug.events import Event, Severity
from eventbus_debug.threads import DaemonWorker

from ._checks import seconds
from ._metrics import Note, Point, StepClock, metrics_of

__all__ = ("WandbSink",)


def _wandb() -> Any:
    try:
        import wandb
    except ImportError:
        msg = "WandbSink needs wandb, the optional 'wandb' extra: pip install -e '.[wandb]'"
        raise ImportError(msg) from None
    return wandb


class WandbSink:
    """Log the run's scalars to a W&B run and raise W&B alerts for its incidents.

    Args:
        run: a run from ``wandb.init()``; ``None`` starts one with *init* (and finishes it
            at close).
        alert_cooldown: seconds during which repeats of an incident kind (per rank) are
            counted instead of alerted; ``0`` alerts every incident.
        alert_min_severity: incidents below this severity are logged, never alerted. Alerts
            are raised for anomalies (non-finite values, explosions, spikes, leaks...) and for
            any incident of ERROR severity or above, never for recovery's own reports.
        per_layer: log per-parameter gradient norms and update ratios (ADVANCED and above).
        clock: a monotonic clock in seconds for the cooldown (inject a fake one in tests).
        name: the subscription name the bus uses.
        **init: keyword arguments for ``wandb.init`` when *run* is None (``project``,
            ``mode="offline"``, ``dir``...).

    Raises:
        ImportError: if wandb is not installed.
        ArgumentTypeError: if *alert_cooldown* is not a number (a ``TypeError``, and the
            ``ValueError`` earlier releases raised).
        ValueError: if *alert_cooldown* is negative or not finite, or both *run* and *init* are given.
        TypeError: if *alert_min_severity* is not a Severity.
    """

    def __init__(
        self,
        run: Any = None,
        *,
        alert_cooldown: float = 60.0,
        alert_min_severity: Severity = Severity.WARNING,
        per_layer: bool = True,
        clock: Callable[[], float] = time.monotonic,
        name: str = "wandb",
        **init: Any,
    ) -> None:
        cooldown = seconds(
            "alert_cooldown",
            alert_cooldown,
            rule="a number of seconds >= 0 (finite: W&B's wait_duration)",
            zero=True,
        )
        if not isinstance(alert_min_severity, Severity):
            msg = f"alert_min_severity must be a Severity, got {alert_min_severity!r}"
            raise TypeError(msg)
        if run is not None and init:
            msg = f"pass either a run or wandb.init arguments, not both (got {sorted(init)})"
            raise ValueError(msg)
        self._wandb = _wandb()
        self._owns_run = run is None
        self.run: Any = run if run is not None else self._wandb.init(**init)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.name = name
        self._cooldown = cooldown
        self._min_alert = alert_min_severity
        self._per_layer = per_layer
        self._now = clock
        self._steps = StepClock()
        self._last_alert: dict[tuple[str, int], float] = {}
        self._held: dict[tuple[str, int], int] = {}
        self._closed = False
        # Calls into wandb run in a daemon thread of the sink's: one that hangs (a network
        # sync) can be abandoned by the bus's close bound on every backend (on trio the bus
        # joins the sink's task, so an uncancellable wait would hold the close).
        self._worker = DaemonWorker(f"eventbus-wandb-{name}")
        self.logged = 0
        """Scalars logged so far."""
        self.alerts = 0
        """Alerts raised so far."""

    @property
    def thread_busy(self) -> bool:
        """Whether the sink's thread is inside a call into wandb now (a hung one stays busy)."""
        return self._worker.busy

    def __repr__(self) -> str:
        return f"<WandbSink run={getattr(self.run, 'id', '?')}>"

    async def handle(self, event: Event, /) -> None:
        """Log one event (the bus prefers :meth:`handle_batch`)."""
        await self.handle_batch((event,))

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        """Group *events* by step and decide the alerts here; log them in a worker thread.

        Raises:
            RuntimeError: if the sink is closed.
        """
        if self._closed:
            msg = f"{self!r} is closed"
            raise RuntimeError(msg)
        points, notes = metrics_of(events, self._steps, per_layer=self._per_layer)
        alerts = [a for a in (self._decide(n) for n in notes) if a is not None]
        if points or alerts:
            await self._worker.run(self._write, points, alerts)

    async def aclose(self) -> None:
        """Alert the held-back repeats, then finish the run if the sink started it. Idempotent.

        ``run.finish()`` can take seconds (wandb syncs its files); if the bus's close bound
        abandons it, it completes in its thread, and wandb's own exit hook finishes the run
        at the latest when the process exits.
        """
        if self._closed:
            return
        self._closed = True
        held = [(key, n) for key, n in self._held.items() if n]
        self._held.clear()
        try:
            # Abandoned, not waited for, past the close's bound: they complete in the thread.
            if held:
                await self._worker.run(self._alert_held, held)
            if self._owns_run:
                await self._worker.run(self.run.finish)
        finally:
            self._worker.stop()

    def _decide(self, note: Note) -> tuple[Note, int] | None:
        """The note to alert with how many repeats it stands for, or None (cooldown)."""
        if note.severity < self._min_alert or not (note.anomaly or note.severity >= Severity.ERROR):
            return None
        key = (note.kind, note.rank)
        now = self._now()
        last = self._last_alert.get(key)
        if last is not None and now - last < self._cooldown:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last_alert[key] = now
        return note, self._held.pop(key, 0)

    def _level(self, severity: Severity) -> Any:
        levels = self._wandb.AlertLevel
        if severity >= Severity.ERROR:
            return levels.ERROR
        return levels.WARN if severity >= Severity.WARNING else levels.INFO

    def _write(self, points: list[Point], alerts: list[tuple[Note, int]]) -> None:
        rows: dict[int, dict[str, float]] = {}
        for p in points:
            rows.setdefault(p.step, {"step": p.step})[p.tag] = p.value
        for step in sorted(rows):
            self.run.log(rows[step])
        self.logged += len(points)
        for note, held in alerts:
            more = f" ({held} more since the last alert)" if held else ""
            rank = f" rank {note.rank}" if note.rank else ""
            self.run.alert(
                title=f"{note.kind}{rank}",
                text=f"step {note.step}: {note.text}{more}",
                level=self._level(note.severity),
                wait_duration=self._cooldown,
            )
            self.alerts += 1

    def _alert_held(self, held: list[tuple[tuple[str, int], int]]) -> None:
        for (kind, rank), n in held:
            # A title of its own: W&B suppresses an alert whose title was alerted within
            # wait_duration, and the kind's own alert is usually that recent at close.
            self.run.alert(
                title=f"{kind}{f' rank {rank}' if rank else ''} (held back)",
                text=f"{n} more {kind} incident(s) held back by the cooldown",
                level=self._wandb.AlertLevel.WARN,
                wait_duration=self._cooldown,
            )
            self.alerts += 1
