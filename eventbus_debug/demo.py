"""The demo behind ``eventbus-debug demo``: a small async training run, debugged end to end.

A small MLP learns a synthetic regression task in an async loop inside a :class:`Session`
(rotating log, report, alerts, console, step probe, recovery). Faults are injected at known
steps, so a run shows every part at work:

- a NaN in a batch: the probe reports non-finite loss and gradients, recovery skips the step;
- a batch scaled by 1e4 (after the probe's warm-up): gradients explode, recovery clips them;
- a batch too large for the (simulated) device: ``torch.OutOfMemoryError``, recovery halves
  the batch and the step is retried;
- a leaking list that keeps every step's loss *with its graph*: the session's leak detector
  sees graph-holding tensors survive and pile up, and reports a ``MemoryLeakSuspected``.

The session also runs the system sampler (CPU / memory / disk readings on a timer).

On the console the run shows a progress bar (rich when installed, else tqdm, else a line every
tenth of the run) and each incident once, as one line, through the bar.

Everything is seeded: two runs with the same arguments give the same events (times aside).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from .events import Event, StepCompleted
from .log.files import log_files
from .probes.memory import LeakDetector, LeakThresholds
from .recovery.retry import CallState, Retrying
from .session import Session

__all__ = ("DemoFaults", "DemoResult", "run_demo")

DEFAULT_STEPS = 1500
_FEATURES = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoFaults:
    """The steps at which the demo injects its faults (``None``: not injected).

    Attributes:
        nan_step: a NaN enters the batch.
        explode_step: the batch is scaled by 1e4 (gradients explode).
        oom_step: from this step on the loader yields batches twice too large for the device.
        leak_start: from this step on each loss is kept with its graph (a leak)...
        leak_stop: ... until this step, when the list is released.
    """

    nan_step: int | None
    explode_step: int | None
    oom_step: int | None
    leak_start: int | None
    leak_stop: int | None

    @classmethod
    def for_steps(cls, steps: int) -> DemoFaults:
        """Faults spread over a run of *steps* steps (none when it is shorter than 20)."""
        if steps < 20:
            return cls(
                nan_step=None, explode_step=None, oom_step=None, leak_start=None, leak_stop=None
            )
        return cls(
            nan_step=int(steps * 0.3),
            explode_step=int(steps * 0.5),
            oom_step=int(steps * 0.6),
            leak_start=int(steps * 0.7),
            leak_stop=int(steps * 0.8),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoResult:
    """What a demo run produced.

    Attributes:
        log_dir: the directory holding the JSON-lines log and the report.
        log_files: the log files written, oldest first.
        report_html: the HTML report (None when not written).
        report_json: the JSON report (None when not written).
        steps: how many training steps ran.
        first_loss: the loss of the first step.
        final_loss: the loss of the last step.
        skipped_steps: the steps whose optimizer step was skipped by recovery.
        batch_size: the batch size at the end (recovery halves it after an OOM).
        published: how many events the bus published.
        faults: the faults injected.
    """

    log_dir: Path
    log_files: tuple[Path, ...]
    report_html: Path | None
    report_json: Path | None
    steps: int
    first_loss: float
    final_loss: float
    skipped_steps: tuple[int, ...]
    batch_size: int
    published: int
    faults: DemoFaults


def _model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(_FEATURES, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 1),
    )


class _Device:
    """A pretend accelerator with room for *capacity* samples per batch: larger batches OOM."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def check(self, batch: torch.Tensor) -> None:
        if batch.shape[0] > self.capacity:
            msg = (
                f"CUDA out of memory. Tried to allocate a batch of {batch.shape[0]} samples "
                f"(device capacity {self.capacity}) [simulated by the demo]"
            )
            raise torch.OutOfMemoryError(msg)


class _ProgressBar:
    """The demo's progress bar on *out*, fed by ``StepCompleted`` events: a sink on the bus.

    rich when installed, else tqdm, else a plain line every tenth of the run. Being a sink,
    the bus closes it when the session ends, also when training raises. Incident lines written
    meanwhile go through the bar: rich redirects ``sys.stderr`` while it shows, and the console
    sink writes through ``tqdm.write`` when a tqdm bar is active.
    """

    name = "progress"

    def __init__(self, out: TextIO | None, total: int) -> None:
        self._out = out
        self._total = total
        self._bar: Any = None
        self._task: Any = None
        self._started = False
        self._last_line = 0

    def _start(self) -> None:
        self._started = True
        out = self._out if self._out is not None else sys.stderr
        if importlib.util.find_spec("rich") is not None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]demo[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(file=out),
                redirect_stdout=False,
            )
            self._task = self._bar.add_task("demo", total=self._total, loss="-")
            self._bar.start()
        elif importlib.util.find_spec("tqdm") is not None:
            import tqdm  # type: ignore[import-untyped,unused-ignore]

            self._bar = tqdm.tqdm(total=self._total, file=out, desc="demo", unit="step")

    async def handle_batch(self, events: Sequence[Event], /) -> None:
        """Move the bar to the latest completed step of *events*."""
        steps = [e for e in events if isinstance(e, StepCompleted) and e.step is not None]
        if not steps:
            return
        if not self._started:
            self._start()
        last = steps[-1]
        done = min(self._total, (last.step or 0) + 1)
        loss = "-" if last.loss is None else f"{last.loss:.4g}"
        if self._task is not None:
            self._bar.update(self._task, completed=done, loss=loss)
        elif self._bar is not None:
            self._bar.update(done - self._bar.n)
            self._bar.set_postfix_str(f"loss {loss}", refresh=False)
        elif done - self._last_line >= max(1, self._total // 10) or done == self._total:
            self._last_line = done
            out = self._out if self._out is not None else sys.stderr
            out.write(f"demo: step {done}/{self._total} loss {loss}\n")
            out.flush()

    async def aclose(self) -> None:
        """Stop the bar (it stays on screen, complete). Idempotent."""
        bar, self._bar = self._bar, None
        if bar is not None:
            if self._task is not None:
                bar.stop()
            else:
                bar.close()


async def run_demo(
    log_dir: Path,
    *,
    steps: int = DEFAULT_STEPS,
    batch_size: int = 64,
    width: int = 128,
    seed: int = 0,
    faults: DemoFaults | None = None,
    console: bool = True,
    stream: TextIO | None = None,
) -> DemoResult:
    """Train a small MLP on synthetic data for *steps* steps with faults injected, debugged.

    Args:
        log_dir: where the log and the report are written (created when missing).
        steps: training steps; the default takes well under a minute on 2 CPU cores.
        batch_size: samples per step (the simulated device holds exactly this many).
        width: hidden width of the MLP.
        seed: seeds torch and the data.
        faults: which faults to inject at which steps (default: :meth:`DemoFaults.for_steps`).
        console: show a progress bar and each incident (and recovery decision) once on
            *stream*.
        stream: where the console view goes (``sys.stderr`` when None).

    Returns:
        What the run produced and where.

    Raises:
        ValueError: if *steps*, *batch_size* or *width* is below 1.
        sinks.LogDirectoryError: if *log_dir* cannot be created or written.
    """
    for name, value in (("steps", steps), ("batch_size", batch_size), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            msg = f"{name} must be an int >= 1, got {value!r}"
            raise ValueError(msg)
    from . import sinks

    # A 128-wide MLP gains nothing from intra-op threads, and on a shared machine they
    # oversubscribe the cores (measured 8x slower under load): one thread for the run.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        log_dir = Path(log_dir)
        faults = faults if faults is not None else DemoFaults.for_steps(steps)
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = _model(width)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        true_w = torch.randn(_FEATURES, 1, generator=gen)
        device = _Device(batch_size)
        # The console shows incidents only (each once, one line); progress is the bar's job, and
        # steps, memory and system samples are plotted in the report.
        console_sink: sinks.ConsoleSink | bool = sinks.ConsoleSink(stream) if console else False
        extra_sinks = [_ProgressBar(stream, steps)] if console else []
        first_loss = math.nan
        loss_value = math.nan
        skipped: list[int] = []
        leak: list[torch.Tensor] = []
        # A heap scan costs milliseconds: about 100 samples over the run, fitted 6 at a time.
        detector = LeakDetector(
            every=max(2, steps // 100),
            thresholds=LeakThresholds(window=6, warmup=2),
            source="demo.memory",
        )
        async with Session(
            model,
            optimizer,
            log_dir=log_dir,
            name="demo",
            console=console_sink,
            sinks=extra_sinks,
            leak_detector=detector,
        ) as session:
            engine = session.recovery
            if engine is None:  # pragma: no cover - the session always builds one here
                msg = "the demo needs the session's recovery engine"
                raise RuntimeError(msg)
            retry = Retrying(engine, state=CallState(batch_size=batch_size), operation="train_step")
            for step in range(steps):
                if step == faults.oom_step:
                    # The data pipeline starts yielding batches twice too large for the device.
                    retry.state.batch_size = batch_size * 2
                async for attempt in retry:
                    async with attempt:
                        size = attempt.state.batch_size or batch_size
                        x = torch.randn(size, _FEATURES, generator=gen)
                        # Clean targets: the loss converges towards zero and keeps wobbling; the
                        # default detectors judge that against the run's own noise (no false alarm).
                        y = torch.sin(x @ true_w)
                        if step == faults.nan_step:
                            x[0, 0] = math.nan
                        if step == faults.explode_step:
                            x = x * 1e4
                        device.check(x)
                        optimizer.zero_grad(set_to_none=True)
                        loss = nn.functional.mse_loss(model(x), y)
                        torch.autograd.backward(loss)
                if (
                    faults.leak_start is not None
                    and faults.leak_stop is not None
                    and faults.leak_start <= step < faults.leak_stop
                ):
                    leak.append(loss)  # the bug: keeps every step's graph alive
                elif leak and step == faults.leak_stop:
                    leak.clear()
                verdict = await session.check_step(step, loss=loss)
                if verdict.should_step:
                    optimizer.step()
                else:
                    skipped.append(step)
                loss_value = float(loss.detach())
                if step == 0:
                    first_loss = loss_value
                await session.step_completed(step, loss=loss_value, samples=int(x.shape[0]))
            final_batch = retry.state.batch_size or batch_size
            published = session.bus.statistics().published
        html = log_dir / "report.html"
        js = log_dir / "report.json"
        if console:
            out = stream or sys.stderr
            out.write(
                f"\ndemo finished: {session.steps_completed} steps, optimizer step skipped at "
                f"{list(skipped) or 'no step'}, final batch size {final_batch}\n"
            )
            out.flush()
        return DemoResult(
            log_dir=log_dir,
            log_files=tuple(p for ps in log_files(log_dir).values() for p in ps),
            report_html=html if html.exists() else None,
            report_json=js if js.exists() else None,
            steps=session.steps_completed,
            first_loss=first_loss,
            final_loss=loss_value,
            skipped_steps=tuple(skipped),
            batch_size=final_batch,
            published=published,
            faults=faults,
        )
    finally:
        torch.set_num_threads(threads)
