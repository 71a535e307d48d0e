"""Localization armed by incidents: what ``DebugMode.ANOMALY_DETECTION`` turns on.

After a non-finite incident the first-NaN locator must run, bounded in time. Two ways:

- **replay** (:meth:`AnomalyArming.replay`): a session's ``training_step`` has the batch, so it
  replays the failed step once with the hooks armed and publishes the
  :class:`~eventbus_debug.events.AnomalyLocalized` of that step;
- **the next passes**: a loop that only calls ``check_step`` gives no batch to replay. The
  incident then arms the hooks for the next *passes* forward/backward passes of the model, each
  pass judged when the next one starts (or at :meth:`AnomalyArming.close`), and disarms them as
  soon as the origin is found or the window ends. A window is followed by a cool-down, so a
  run that stays NaN does not keep the hooks armed for good.

A :class:`AnomalyArming` keeps one forward pre-hook on the model's root (one Python call per
forward); everything else is installed only while armed. Arming is requested from the bus
(any thread: it only records the incident's step) and done on the training thread, at the
start of the next forward pass, so hooks are never added while the model runs elsewhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, Protocol

import anyio.lowlevel
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._bus import Subscription
from ..diagnostics import get_logger
from ..events import AnomalyLocalized, Event, NonFiniteDetected
from ..typing import Publisher
from .localize import FirstNonFiniteLocator

__all__ = (
    "DEFAULT_COOLDOWN",
    "DEFAULT_PASSES",
    "AnomalyArming",
    "RngState",
    "Subscribable",
    "arm_on_incidents",
)

_log = get_logger(__name__)

DEFAULT_PASSES: Final = 3
"""Forward/backward passes the hooks stay armed for after an incident, without a replay."""

DEFAULT_COOLDOWN: Final = 50
"""Passes after a window during which new incidents do not re-arm the hooks."""

StepSource = Callable[[], "int | None"]


@dataclass(frozen=True, slots=True)
class RngState:
    """The random state a forward pass ran with, so a replay draws the same dropout masks."""

    cpu: torch.Tensor
    cuda: tuple[int, torch.Tensor] | None = None

    @classmethod
    def capture(cls, model: nn.Module) -> RngState:
        """The CPU generator's state, and that of the CUDA device *model* lives on, if any."""
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        cuda = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            cuda = (index, torch.cuda.get_rng_state(index))
        return cls(torch.random.get_rng_state(), cuda)


@contextlib.contextmanager
def _isolated(model: nn.Module, rng: RngState | None) -> Iterator[None]:
    """Run a replay that leaves no trace: buffers restored, random state as before."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [rng.cuda[0]] if rng is not None and rng.cuda is not None else []
    try:
        with torch.random.fork_rng(devices=devices, enabled=rng is not None):
            if rng is not None:
                torch.random.set_rng_state(rng.cpu)
                if rng.cuda is not None:
                    torch.cuda.set_rng_state(rng.cuda[1], rng.cuda[0])
            yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


class AnomalyArming:
    """Arms a :class:`FirstNonFiniteLocator` after non-finite incidents, bounded in time.

    Example::

        arming = AnomalyArming(FirstNonFiniteLocator(model, bus), step=lambda: session.step)
        arming.install()
        bus.subscribe(arming.handle, NonFiniteDetected)
        ...  # the next passes after a NaN are watched; AnomalyLocalized is published
        arming.close()

    Args:
        locator: the locator to arm (its bus receives the findings).
        step: returns the step the last completed pass belongs to (a session's ``step``).
        passes: how many passes stay armed after an incident (at least 1).
        cooldown: passes after a window during which incidents do not re-arm (at least 0).

    Raises:
        TypeError: if *locator* is not a :class:`FirstNonFiniteLocator` or *step* not callable.
        ValueError: if *passes* < 1 or *cooldown* < 0.
    """

    def __init__(
        self,
        locator: FirstNonFiniteLocator,
        *,
        step: StepSource,
        passes: int = DEFAULT_PASSES,
        cooldown: int = DEFAULT_COOLDOWN,
    ) -> None:
        if not isinstance(locator, FirstNonFiniteLocator):
            msg = f"locator must be a FirstNonFiniteLocator, got {type(locator).__qualname__}"
            raise TypeError(msg)
        if not callable(step):
            msg = f"step must be a callable returning the current step, got {step!r}"
            raise TypeError(msg)
        for arg, value, least in (("passes", passes, 1), ("cooldown", cooldown, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                msg = f"{arg} must be an integer >= {least}, got {value!r}"
                raise ValueError(msg)
        self.locator = locator
        self.passes = passes
        self.cooldown = cooldown
        self._step = step
        self._root: RemovableHandle | None = None
        self._requested: int | None = None  # the step of the latest incident to answer
        self._answered: int | None = None  # the last step localized (replayed or watched)
        self._left = 0  # passes still armed in the current window
        self._quiet = 0  # passes of cool-down left
        self.windows = 0
        """How many times the hooks were armed for the next passes."""
        self.found: list[AnomalyLocalized] = []
        """Every finding published, in order."""

    @property
    def model(self) -> nn.Module:
        """The locator's model."""
        return self.locator.model

    def install(self) -> None:
        """Put the root forward pre-hook on the model (idempotent)."""
        if self._root is None:
            self._root = self.model.register_forward_pre_hook(self._on_forward)

    def close(self) -> None:
        """Judge the pass under way, publish what it found, and remove every hook."""
        if self.locator.is_armed or self.locator.has_records:
            self._judge()
        self.locator.disarm()
        if self._root is not None:
            self._root.remove()
            self._root = None

    # -- requests -------------------------------------------------------------------------------

    async def handle(self, event: NonFiniteDetected) -> None:
        """Bus subscriber: a non-finite incident asks for localization."""
        self.request(event.step)

    def request(self, step: int | None) -> None:
        """Ask for the next passes to be watched (thread-safe: only records *step*)."""
        if step is None:
            step = self._step()
        wanted = -1 if step is None else step
        current = self._requested
        self._requested = wanted if current is None else max(current, wanted)

    def answered(self, step: int | None) -> None:
        """Say that *step* was localized already (a replay): incidents up to it need nothing."""
        if step is not None and (self._answered is None or step > self._answered):
            self._answered = step

    # -- replay ---------------------------------------------------------------------------------

    async def replay(
        self, run: Callable[[], object], *, step: int | None, rng: RngState | None = None
    ) -> AnomalyLocalized | None:
        """Replay a failed step with the hooks armed and publish where its NaN/Inf was made.

        The replay leaves no trace on the model: its buffers (BatchNorm running statistics)
        are restored after it, and with *rng* (captured before the original forward pass) it
        draws the same random numbers (dropout masks) without changing the generators' state.
        Gradients it accumulates are the caller's to clear. It runs eagerly (``torch.compile``
        directives are ignored during it), so a compiled model's layers are localized too.
        """
        found = self.replay_sync(run, step=step, rng=rng)
        await anyio.lowlevel.checkpoint()  # after the random state is back
        return found

    def replay_sync(
        self, run: Callable[[], object], *, step: int | None, rng: RngState | None = None
    ) -> AnomalyLocalized | None:
        """:meth:`replay` for synchronous loops."""
        self.answered(step)
        # eager: a compiled forward does not run hooks added after compiling (the localizer's)
        with _isolated(self.model, rng), torch.compiler.set_stance("force_eager"):
            found = self.locator.localize_sync(run, step=step)
        if found is not None:
            self.found.append(found)
        return found

    # -- the next passes ------------------------------------------------------------------------

    def _on_forward(self, module: nn.Module, args: object) -> None:
        try:
            if self.locator.is_armed:
                if self.locator.has_records:  # the previous pass is complete: judge it
                    self._judge()
                return
            if self._quiet:
                self._quiet -= 1
                return
            wanted = self._requested
            if wanted is None or (self._answered is not None and wanted <= self._answered):
                self._requested = None
                return
            self._requested = None
            self._left = self.passes
            self.windows += 1
            self.locator.arm()
            _log.info("localization_armed", passes=self.passes, after_step=wanted)
        except Exception:  # a probe never raises into the user's forward
            _log.warning("anomaly_arming_failed", exc_info=True)

    def _judge(self) -> None:
        step = self._step()
        found = self.locator.result(step=step)
        self._left -= 1
        if found is not None:
            self.locator.publish(found)
            self.found.append(found)
            self.answered(step)
        if found is not None or self._left <= 0:
            self.locator.disarm()
            self._quiet = self.cooldown
            self.answered(step)


class Subscribable(Publisher, Protocol):
    """**Protocol:** a publisher that also takes subscriptions: either bus."""

    def subscribe(
        self, sink: object, /, *event_types: type[Event], name: str | None = None
    ) -> Subscription:
        """Deliver events of *event_types* to *sink*."""


def arm_on_incidents(
    model: nn.Module,
    bus: Subscribable,
    *,
    step: StepSource,
    name: str,
    passes: int = DEFAULT_PASSES,
) -> tuple[AnomalyArming, Subscription]:
    """An installed :class:`AnomalyArming` for *model*, subscribed to *bus*'s incidents.

    What a session in ``DebugMode.ANOMALY_DETECTION`` runs: findings are published on *bus*
    with the source ``"{name}.localizer"``. Call :meth:`AnomalyArming.close` at the end.
    """
    source = f"{name}.localizer"
    arming = AnomalyArming(
        FirstNonFiniteLocator(model, bus, source=source), step=step, passes=passes
    )
    arming.install()
    subscription = bus.subscribe(arming.handle, NonFiniteDetected, name=source)
    return arming, subscription
