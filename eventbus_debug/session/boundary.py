"""The step boundary: probe -> leak check -> safe point -> :class:`Verdict`, written once.

Each step's logic is one generator body that *yields* where it must wait (for the probe, the
safe point, the hand-over of the step's events), each wait given in both colours (a
``Wait``). :meth:`StepBoundary.check_sync` drives a body blocking, ``training_step`` drives it
with ``await``. The two per-step async entries, :meth:`StepBoundary.check` and
:meth:`StepBoundary.completed`, call the same parts of the body around the same waits without
the generator (a few µs a step, and every line costs about three times as much inside a
training loop as alone). So the async and the sync session run the same code between their
waits, in the same order.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Final, NoReturn, TypeAlias, TypeVar

import anyio.lowlevel
import torch
from torch import nn

from .._tensors import batch_size
from .._validate import INT64_MAX
from ..diagnostics import get_logger
from ..events import Event, StepCompleted, StepSkipped, UsageWarning
from ..extras.validation import InputValidator, OutputChecker, Violation
from ..probes import AnomalyArming, LeakDetector, StepProbe, StepProfiler, StepVerdict
from ..probes.anomaly_arming import RngState
from ..recovery import SafePoint, ScalerMonitor, StepDecision
from ..recovery.device_skip import DeviceSkip
from ..typing import Publisher
from ._arguments import checked_loss, completed_values, loss_argument, sample_count
from .budget import OverheadMeter
from .verdict import TrainingStepResult, Verdict

__all__ = ("Body", "StepBoundary", "Wait", "run", "run_sync")

LONE_EVERY: Final = 64
"""A session that did not agree at its entry asks torch whether a process group exists at its
first check and every this many checks after (see :attr:`StepBoundary.lone`)."""

R = TypeVar("R")

_SKIP: Final = ("skip_step",)
_TENSOR: Final = torch.Tensor
"""``torch.Tensor`` as one global: the per-step type test skips an attribute lookup (~40 ns)."""


Wait: TypeAlias = tuple[Callable[[], Awaitable[Any]], Callable[[], Any]]
"""One wait of a step's body, in both colours: ``(wait, block)``, the async entry awaits
``wait()``, the blocking one calls ``block()``. A plain tuple: a frozen dataclass would cost
a microsecond per wait, on every step."""

Body = Generator[Wait, Any, R]
"""A step's logic: yields its waits, receives their results, returns the outcome."""


async def run(body: Body[R]) -> R:
    """Drive *body*, awaiting each of its waits; an error closes the body and propagates."""
    try:
        wait = next(body)
        while True:
            wait = body.send(await wait[0]())
    except StopIteration as done:
        result: R = done.value
        return result
    except BaseException:
        body.close()
        raise


def run_sync(body: Body[R]) -> R:
    """Drive *body*, blocking on each of its waits; an error closes the body and propagates."""
    try:
        wait = next(body)
        while True:
            wait = body.send(wait[1]())
    except StopIteration as done:
        result: R = done.value
        return result
    except BaseException:
        body.close()
        raise


_log = get_logger(__name__)


class _StepsBeforeCheck:
    """Whether *optimizer* stepped between the session's start and its first check: a hook
    on the optimizer's steps until that check (then removed; it holds nothing but a flag)."""

    __slots__ = ("_handle", "stepped")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.stepped = False
        self._handle = optimizer.register_step_post_hook(self._hook)

    def _hook(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        self.stepped = True  # not removed here: the optimizer is iterating its hooks

    def close(self) -> bool:
        """Remove the hook; whether the optimizer stepped before."""
        self._handle.remove()
        return self.stepped


def _concurrent(entry: str) -> NoReturn:
    """Refuse a blocking *entry* called while another thread is inside one."""
    msg = (
        f"{entry} was called from thread {threading.current_thread().name!r} while another "
        "thread is inside training_step, check_step or step_completed of the same session: a "
        "session checks one training loop, whose steps must not overlap (its step numbers, "
        "baselines and safe point would be garbled); use one session per thread, or a lock "
        "around the whole step"
    )
    raise RuntimeError(msg)


class StepBoundary:
    """Where a training step meets the debugger: the checks after backward, the record after
    the optimizer step, and a whole checked step.

    Built by a running session from its parts; the session's ``check_step``,
    ``step_completed`` and ``training_step`` are its entries (``x`` async, ``x_sync``
    blocking).

    Args:
        model: the checked model.
        optimizer: its optimizer (None: no safe point, no ``training_step``).
        name: the source of the boundary's own events.
        publisher: where the boundary's events go, never waiting.
        probe: the step probe.
        safe_point: where recovery decisions are applied (None without recovery).
        amp: the GradScaler's watcher (None without a scaler).
        leak_detector: run at every safe point (None when off).
        profiler: stepped at every completed step (None when off).
        anomaly: the localization hooks, replaying a failed step (None when off).
        validator: checks ``training_step``'s inputs (None when off).
        output_checker: checks ``training_step``'s outputs (None when off).
        skip_non_finite: without recovery, advise skipping a non-finite step.
        overhead_budget: the share of the step time the session may cost (``None``: measured,
            not enforced); see :class:`~eventbus_debug.session.budget.OverheadMeter`.
        device_skip: hands the step's found-inf flag to the fused optimizer (None when off):
            a non-finite step is then stepped, and skipped on the device.
        publish: how the async entries hand a finished step's event over (default:
            ``publish_nowait`` and one checkpoint); an ``EventBus.publish`` also waits for a
            flow-controlled log that is behind.
        flush: how the blocking entries hand a finished step's events over
            (``SyncEventBus.flush``; default: nothing more than ``publish_nowait``).
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        name: str,
        publisher: Publisher,
        probe: StepProbe,
        safe_point: SafePoint | None = None,
        amp: ScalerMonitor | None = None,
        leak_detector: LeakDetector | None = None,
        profiler: StepProfiler | None = None,
        anomaly: AnomalyArming | None = None,
        validator: InputValidator | None = None,
        output_checker: OutputChecker | None = None,
        skip_non_finite: bool = True,
        overhead_budget: float | None = None,
        device_skip: DeviceSkip | None = None,
        publish: Callable[[Event], Awaitable[None]] | None = None,
        flush: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.name = name
        self.publisher = publisher
        self.probe = probe
        self.safe_point = safe_point
        self.amp = amp
        self.leak_detector = leak_detector
        self.profiler = profiler
        self.anomaly = anomaly
        self.validator = validator
        self.output_checker = output_checker
        self.skip_non_finite = skip_non_finite
        self.device_skip = device_skip
        self.lone: Callable[[], None] | None = None
        """Set by a session that would have agreed had a process group existed at its entry
        (``distributed=None``): called at the first check and every :data:`LONE_EVERY`-th
        after, it raises once one exists (asking torch costs ~2 µs inside a training loop)."""
        self._lone_in = 0  # checks until the next call of lone
        self._publish = publish
        self._flush = flush
        self.meter = OverheadMeter(probe, overhead_budget)
        """The session's own cost per step (and the budget keeping it in bounds)."""
        self.step: int | None = None
        """The step being checked or last completed (None before the first)."""
        self._went_back = False  # step_went_back was logged
        self._order = _StepsBeforeCheck(optimizer) if optimizer is not None else None
        """Watches the optimizer's steps until the first check (then None)."""
        self._told: tuple[int, int] = (-1, 0)  # the step whose check was told its samples
        self.steps_completed = 0
        self._last_step_t: float | None = None
        self._busy = threading.RLock()
        """Held by the thread inside a blocking entry: another thread's call is refused (one
        session checks one loop; two threads' steps would interleave and garble its state)."""

    # -- the entries ------------------------------------------------------------------------------

    async def check(
        self, step: int, loss: torch.Tensor | float | None = None, samples: int | None = None
    ) -> Verdict:
        """Run the checks due at *step* and the safe point; say whether to step."""
        # The body of _check without its generator (this runs on every step): the same parts
        # around the same two waits.
        started = self._check_begin(step)
        if loss is not None and loss.__class__ is not _TENSOR and loss.__class__ is not float:
            loss = loss_argument(loss)  # a numpy scalar as a float; the probe checks the rest
        # Neither the probe nor the safe point yields: the step's one turn of the event loop
        # is step_completed's hand-over. Each is awaited only when it must wait (reductions
        # offloaded to a thread, incidents for the engine); a healthy step calls both inline.
        probe = self.probe
        verdict = probe.check_inline(step, loss, samples)
        if verdict is None:
            verdict = await probe.check_step(step, loss=loss, checkpoint=False, samples=samples)
        self._probed(step, loss, verdict, samples)
        safe_point = self.safe_point
        if safe_point is None:
            return self._check_end(started, self._verdict(step, verdict))
        decision = safe_point.before_optimizer_step_inline(step, loss=verdict.loss)
        if decision is None:
            decision = await safe_point.before_optimizer_step(step, loss=verdict.loss)
        return self._check_end(started, self._decided(step, verdict, safe_point, decision))

    def check_sync(
        self, step: int, loss: torch.Tensor | float | None = None, samples: int | None = None
    ) -> Verdict:
        """:meth:`check`, blocking.

        Raises:
            RuntimeError: if another thread is inside a blocking entry of this boundary.
        """
        return self._alone("check_step", self._check(step, loss, samples))

    def _alone(self, entry: str, body: Body[R]) -> R:
        """Drive *body* blocking, unless another thread is inside a blocking entry (then
        :func:`_concurrent` names *entry*)."""
        busy = self._busy
        if not busy.acquire(False):
            body.close()
            _concurrent(entry)
        try:
            return run_sync(body)
        finally:
            busy.release()

    async def completed(
        self,
        step: int,
        *,
        loss: float | torch.Tensor | None = None,
        learning_rate: float | None = None,
        samples: int | None = None,
    ) -> None:
        """Record that *step* finished and hand its events over."""
        # The body of _completed without its generator (this runs on every step): the same
        # two halves around the async hand-over.
        started, event = self._completed_begin(step, loss, learning_rate, samples)
        await self._hand_over(event)
        self._completed_end(started)

    def completed_sync(
        self,
        step: int,
        *,
        loss: float | torch.Tensor | None = None,
        learning_rate: float | None = None,
        samples: int | None = None,
    ) -> None:
        """:meth:`completed`, blocking.

        Raises:
            RuntimeError: if another thread is inside a blocking entry of this boundary.
        """
        self._alone("step_completed", self._completed(step, loss, learning_rate, samples))

    async def training_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        step: int | None = None,
        samples: int | None = None,
    ) -> TrainingStepResult:
        """One fully checked step: validate, forward, backward, check, step, record."""
        return await run(self._training_step(inputs, targets, loss_fn, step, samples))

    def training_step_sync(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        step: int | None = None,
        samples: int | None = None,
    ) -> TrainingStepResult:
        """:meth:`training_step`, blocking.

        Raises:
            RuntimeError: if another thread is inside a blocking entry of this boundary.
        """
        return self._alone(
            "training_step", self._training_step(inputs, targets, loss_fn, step, samples)
        )

    def next_step(self, step: int | None) -> int:
        """*step*, or the one after the last (0 at first)."""
        if step is not None:
            return step
        return 0 if self.step is None else self.step + 1

    # -- the bodies -------------------------------------------------------------------------------

    def _check(
        self, step: int, loss: torch.Tensor | float | None, samples: int | None = None
    ) -> Body[Verdict]:
        """The checks of a step as a body (``check_sync``'s and ``training_step``'s);
        :meth:`check` runs the same parts around the same waits directly."""
        started = self._check_begin(step)
        if loss is not None and loss.__class__ is not _TENSOR and loss.__class__ is not float:
            loss = loss_argument(loss)  # a numpy scalar as a float; the probe checks the rest
        probe = self.probe
        verdict: StepVerdict = yield (
            lambda: probe.check_step(step, loss=loss, checkpoint=False, samples=samples),
            lambda: probe.check_step_sync(step, loss=loss, samples=samples),
        )
        self._probed(step, loss, verdict, samples)
        safe_point = self.safe_point
        if safe_point is None:
            return self._check_end(started, self._verdict(step, verdict))
        checked = verdict.loss
        decision: StepDecision = yield (
            lambda: safe_point.before_optimizer_step(step, loss=checked),
            lambda: safe_point.before_optimizer_step_sync(step, loss=checked),
        )
        return self._check_end(started, self._decided(step, verdict, safe_point, decision))

    def _check_begin(self, step: int) -> float:
        """The start of a step's checks: the time they started (*step* checked)."""
        if step.__class__ is not int or not 0 <= step <= INT64_MAX:
            StepProbe._validate(step, None)  # a refused step never becomes the session's step
        if self._order is not None:
            self._first_check(step)
        if self.lone is not None:
            if self._lone_in:
                self._lone_in -= 1
            else:
                self._lone_in = LONE_EVERY - 1
                self.lone()
        return self.meter.clock()

    def _first_check(self, step: int) -> None:
        """The first check: say once when the optimizer stepped before it (a check placed
        after ``optimizer.step()`` decides on a step already taken)."""
        order, self._order = self._order, None
        if order is not None and order.close():
            self._usage(
                step,
                "check_after_optimizer_step",
                "check_step ran after an optimizer step: its skips and clips come after the "
                "step they are for; call it after loss.backward() and before optimizer.step()",
            )

    def _usage(self, step: int, problem: str, message: str) -> None:
        """Say a usage *problem* once: in the library's log and as a UsageWarning event."""
        _log.warning(problem, step=step, hint=message)
        self.publisher.publish_nowait(
            UsageWarning(step=step, source=self.name, problem=problem, message=message)
        )

    def _probed(
        self,
        step: int,
        loss: torch.Tensor | float | None,
        verdict: StepVerdict,
        samples: int | None,
    ) -> None:
        """After the probe: *step* becomes the session's step (a loss the probe refused
        leaves it as it was), its *samples* the default of its record, and the probe's
        results go to the parts that take them."""
        if samples is not None:
            self._told = (step, int(samples))
        previous = self.step
        if previous is not None and step < previous and not self._went_back:
            self._went_back = True
            self._usage(
                step,
                "step_went_back",
                f"step {step} came after step {previous}: pass the run's global step, counting "
                "on across epochs (epoch * len(loader) + i); a batch index restarting at 0 "
                "folds the epochs together",
            )
        self.step = step
        if self.device_skip is not None:
            self.device_skip.launched(step, self.probe.in_flight(step), loss, verdict)
        if verdict.overflow and self.amp is not None:
            self.amp.overflowed(verdict.step)
        if self.leak_detector is not None:
            self.leak_detector.observe(step)

    def _decided(
        self, step: int, verdict: StepVerdict, safe_point: SafePoint, decision: StepDecision
    ) -> Verdict:
        """After the safe point: judge the ranks' agreed loss, then the step's verdict."""
        agreed = safe_point.agreed
        if agreed is not None and agreed.loss is not None:
            # the ranks' mean loss, judged for spikes after agreeing (identical on every rank)
            self.probe.observe_global_loss(verdict.step, agreed.loss)
        return Verdict(
            step=step,
            probe=verdict,
            should_step=decision.should_step,
            actions=tuple(a.value for a in decision.actions) if decision.actions else (),
            decision=decision,
        )

    def _check_end(self, started: float, verdict: Verdict) -> Verdict:
        """The end of a step's checks: arm the device-side skip, drop the update measurement
        across a step that changes no weight, count the session's time."""
        if self.device_skip is not None and verdict.should_step:
            self.device_skip.arm()
        if not verdict.should_step or verdict.probe.overflow:
            self.probe.discard_update()
        meter = self.meter
        meter.add(meter.clock() - started)
        return verdict

    def _verdict(self, step: int, verdict: StepVerdict) -> Verdict:
        """The step's verdict without a safe point: the probe's word alone."""
        # An AMP overflow is the scaler's to skip: scaler.step() must still run.
        should = (
            verdict.overflow
            or verdict.finite
            or not self.skip_non_finite
            or self.device_skip is not None  # the device skips it (this verdict is older)
        )
        return Verdict(
            step=step, probe=verdict, should_step=should, actions=() if should else _SKIP
        )

    def _completed(
        self,
        step: int,
        loss: float | torch.Tensor | None,
        learning_rate: float | None,
        samples: int | None,
    ) -> Body[None]:
        started, event = self._completed_begin(step, loss, learning_rate, samples)
        yield (lambda: self._hand_over(event), lambda: self._hand_over_sync(event))
        self._completed_end(started)

    def _completed_begin(
        self,
        step: int,
        loss: float | torch.Tensor | None,
        learning_rate: float | None,
        samples: int | None,
    ) -> tuple[float, StepCompleted]:
        """The record of a finished step, up to its hand-over: ``(start time, its event)``."""
        if not (
            step.__class__ is int
            and 0 <= step <= INT64_MAX
            and (loss is None or loss.__class__ is float)
            and (
                learning_rate is None or (learning_rate.__class__ is float and learning_rate >= 0.0)
            )
            and (samples is None or (samples.__class__ is int and 0 <= samples <= INT64_MAX))
        ):  # the common case costs these tests; anything else (a NaN rate too) is checked first
            loss, learning_rate, samples = completed_values(step, loss, learning_rate, samples)
        if samples is None and self._told[0] == step:
            samples = self._told[1]  # what its check was told
        started = self.meter.clock()
        if self.profiler is not None:
            self.profiler.step(step)
        if self.amp is not None:
            self.amp.completed(step)
        if self.device_skip is not None:
            self.device_skip.disarm()
        return started, self._completed_event(step, loss, learning_rate, samples)

    def _completed_end(self, started: float) -> None:
        """After the hand-over: the session's time for this step, and the step's end."""
        meter = self.meter
        ended = meter.clock()
        meter.step_finished(ended, ended - started)

    def _hand_over(self, event: StepCompleted) -> Awaitable[None]:
        """Hand *event* over; the awaitable of the step's one turn of the event loop (returned,
        not awaited here: no coroutine of its own on the every-step path)."""
        if self._publish is not None:
            return self._publish(event)
        self.publisher.publish_nowait(event)
        return anyio.lowlevel.checkpoint()

    def _hand_over_sync(self, event: StepCompleted) -> None:
        self.publisher.publish_nowait(event)
        if self._flush is not None:
            self._flush()

    def _completed_event(
        self,
        step: int,
        loss: float | None,
        learning_rate: float | None,
        samples: int | None,
    ) -> StepCompleted:
        now = time.perf_counter()
        last, self._last_step_t = self._last_step_t, now
        duration = now - last if last is not None else None
        self.step = step
        self.steps_completed += 1
        if learning_rate is None and self.optimizer is not None:
            lr = self.optimizer.param_groups[0]["lr"]
            learning_rate = lr if type(lr) is float else float(lr)
        return StepCompleted(
            step=step,
            source=self.name,
            loss=loss,
            learning_rate=learning_rate,
            samples_per_s=samples / duration if samples and duration else None,
            duration_s=duration,
        )

    def _training_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        step: int | None,
        samples: int | None,
    ) -> Body[TrainingStepResult]:
        optimizer = self.optimizer
        if optimizer is None:
            msg = "training_step needs an optimizer; pass one to the session"
            raise RuntimeError(msg)
        if not callable(loss_fn):
            msg = (
                "loss_fn must be a callable taking (outputs, targets) and returning the loss "
                f"tensor, got {type(loss_fn).__qualname__} {loss_fn!r}"
            )
            raise TypeError(msg)
        if samples is not None:
            samples = sample_count(samples)
        step = self.next_step(step)
        t0 = time.perf_counter()
        validator = self.validator
        if validator is not None and isinstance(inputs, torch.Tensor):
            violations = validator.check(inputs, publish=self.publisher.publish_nowait, step=step)
            if violations and validator.policy.rejects:  # before the forward pass
                self.publisher.publish_nowait(_rejection(step, violations, source=self.name))
                yield from self._completed(step, None, None, None)
                return _rejected_result(step, violations, t0)
        anomaly = self.anomaly
        rng = RngState.capture(self.model) if anomaly is not None else None
        optimizer.zero_grad(set_to_none=True)
        outputs = self.model(inputs)
        if self.output_checker is not None:
            self.output_checker.check(outputs, publish=self.publisher.publish_nowait, step=step)
        loss = checked_loss(loss_fn(outputs, targets), loss_fn)
        torch.autograd.backward(loss)
        if samples is None:
            samples = batch_size(inputs)
        verdict = yield from self._check(step, loss, samples)
        if verdict.should_step:
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)
        if anomaly is not None and not (verdict.finite or verdict.probe.overflow):
            # replay the failed step with the hooks armed (an AMP overflow is not a fault)
            def replay() -> None:
                torch.autograd.backward(loss_fn(self.model(inputs), targets))

            yield (
                lambda: anomaly.replay(replay, step=step, rng=rng),
                lambda: anomaly.replay_sync(replay, step=step, rng=rng),
            )
            optimizer.zero_grad(set_to_none=True)
        late = verdict.probe.step != step  # a deferred verdict is an earlier step's
        value = verdict.loss if verdict.loss is not None and not late else float(loss.detach())
        yield from self._completed(step, value, None, samples)
        return TrainingStepResult(
            step=step,
            loss=value,
            stepped=verdict.should_step,
            verdict=verdict,
            duration_s=time.perf_counter() - t0,
        )


def _rejection(step: int, violations: Sequence[Violation], *, source: str) -> StepSkipped:
    """The event of a batch rejected by input validation: the step was not run at all."""
    rules = ", ".join(sorted({v.rule for v in violations}))
    return StepSkipped(
        step=step,
        source=source,
        reason=f"input validation rejected the batch before the forward pass ({rules})",
    )


def _rejected_result(
    step: int, violations: Sequence[Violation], started: float
) -> TrainingStepResult:
    """What ``training_step`` returns for a rejected batch: nothing ran, nothing stepped."""
    finite = not any(v.rule == "non_finite" for v in violations)
    probe = StepVerdict(step=step, checked=False, finite=finite, fired=("input_validation_failed",))
    verdict = Verdict(step=step, probe=probe, should_step=False, actions=("reject_batch",))
    return TrainingStepResult(
        step=step,
        loss=math.nan,
        stepped=False,
        verdict=verdict,
        duration_s=time.perf_counter() - started,
    )
