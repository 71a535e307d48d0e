"""One decision per step for the whole process group, on torch.distributed.

Every rank calls :meth:`RankAgreement.agree` at every safe point, whatever its level, cadence or
incidents, before any local state changes. The ranks' pending decisions are encoded as one
small float64 vector (:mod:`.agreement_codec`: one flag per action, factors as maxima of
negatives, each rank's loss in its own slot) and reduced with a single MAX ``all_reduce`` on a
dedicated gloo group whose timeout is far below torch's 30-minute default. Every rank then
applies the same decisions: skip, restore, clip (the smallest max norm of any rank), LR factor
(the smallest), free memory, stop; and judges loss spikes on the same mean loss, so spike
decisions follow at a later safe point on every rank alike. Whether any rank had an incident is
agreed too, so "good steps" (consecutive counts, snapshots, temporary LR changes) advance in
lockstep and a restore lands every rank on the state of the same step.

By default the collective blocks at the safe point: one per safe point on every rank, whatever
the model's graph. ``RankAgreement(overlap=True)`` launches it during DDP's ``backward()``
instead (:mod:`.agreement_overlap`), at the conditions said there.

The agreement is a :class:`~torch.distributed.algorithms.join.Joinable`: with uneven inputs,
``with Join([model, session.agreement]):`` makes a rank that ran out of batches shadow the
others' agreements (after the model's own collectives).

Never a bit mask reduced with MAX: "skip" on one rank and "clip" on another are two flags, and
both survive.

The parts: the :class:`Agreement` protocol and its answers (:mod:`.agreement_types`), the
blocking collective, the join context and the group's end (:mod:`.agreement_blocking`), the
vector (:mod:`.agreement_codec`), the backward hook and the late decisions
(:mod:`.agreement_overlap`); here, :class:`RankAgreement`'s overlapped path and the choice of an
agreement (:func:`agreement_for`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, final

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..diagnostics import get_logger
from ..events import NonFiniteDetected, TensorRole
from . import agreement_codec as codec
from .actions import ClipGradients, DecidedAction, RestoreState, SkipStep
from .agreement_blocking import WAITS_KEPT, BlockingAgreement, _at, _kinds, _same, agreed_stop
from .agreement_codec import Slot
from .agreement_overlap import OutputGradLaunch, split_late
from .agreement_types import (
    AgreedStep as AgreedStep,
    Agreement as Agreement,
    CallAgreed as CallAgreed,
    DecisionSource as DecisionSource,
)

__all__ = (
    "AGREE_TIMEOUT",
    "AgreedStep",
    "Agreement",
    "CallAgreed",
    "DecisionSource",
    "RankAgreement",
    "agreement_for",
    "distributed_active",
)

_log = get_logger(__name__)

AGREE_TIMEOUT: Final = 300.0
"""Seconds a rank waits for the others at an agreement (torch's default is 30 minutes): long
enough for a rank-0-only checkpoint or evaluation between two steps."""
_NON_FINITE_LOSS: Final = NonFiniteDetected(
    source="recovery.agreement", role=TensorRole.LOSS, names=("loss",)
)
"""What a strategy would be asked about a non-finite loss (to know whether one answers)."""


def distributed_active() -> bool:
    """True inside an initialized torch.distributed process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclass(slots=True)
class _Launched:
    """An agreement launched during backward, waited at the next safe point."""

    work: Any  # the async all_reduce's Work (None when launching failed)
    vec: torch.Tensor
    carried: tuple[DecidedAction, ...]  # what this rank sent (for its own reasons)
    loss_grad_bad: bool  # this rank's loss gradient was non-finite
    error: RuntimeError | None = None


@final
class RankAgreement(BlockingAgreement):
    """The :class:`Agreement` of a torch.distributed process group (one collective per step).

    Built by the session when it runs inside an initialized process group (opt out with
    ``Session(..., distributed=False)``). It must be constructed on every rank (it creates a gloo
    group collectively) and called at every safe point on every rank.

    Blocking (``overlap=False``, the default): at the safe point every rank encodes its pending
    decisions, whether it had an incident and its loss in one small float64 vector and
    ``all_reduce``\\ s it with MAX (see :mod:`.agreement_codec`): one collective per safe point
    on every rank, whatever the model's graph, and every decision agreed before any rank
    applies it.

    With uneven inputs, list it after the model in a join context,
    ``with Join([model, session.agreement]):``; a rank out of batches then shadows the others'
    agreements (one per step). ``model.join()`` alone does not, and is refused at the first
    safe point inside it (so is the agreement listed before the model).

    Overlapped (``overlap=True``, opt-in, once :meth:`attach`\\ ed to a
    :class:`~torch.nn.parallel.DistributedDataParallel` model): hides the collective behind
    ``backward()`` (a few percent of a small step) at three conditions: the model's first output
    that requires a gradient is used in the loss on every rank or on none (else the ranks launch
    different numbers of collectives and hang), every rank checks the same steps at the same
    level, and no rank changes its gradients after ``backward()`` (else one rank skips alone and
    the group stops); a restore or stop on a non-finite parameter skips first and acts one safe
    point later. The same vector is launched
    asynchronously when the gradient of the model's output arrives, at the start of
    ``backward()``, carrying what was decided before it, whether this rank's loss gradient is
    finite and the previous step's loss; the safe point only waits for it (it is done by then).
    Every rank skips a step whose loss gradient was non-finite on any rank; what the probe finds
    at the safe point in the all-reduced gradients acts at once (the same on every rank); every
    other late decision acts at the next safe point on every rank
    (:func:`~.agreement_overlap.split_late`); loss spikes are judged on the mean loss one step
    later. What each rank applied rides in the next agreement: ranks that applied different
    decisions stop together, saying so. Steps where the probe checks rank-local state
    (*blocking_at*: parameter or activation checks) add a blocking round.

    Args:
        timeout: seconds a rank waits for the others before it stops, naming its own decision
            (raise it when a rank may pause longer between two steps, e.g. to checkpoint).
        group: the ranks that agree (``None``: a new gloo group over the default group's ranks).
        overlap: hide the agreement behind ``backward()`` where :meth:`attach` allows it (see
            the conditions above; default: block at the safe point).

    Raises:
        RuntimeError: if torch.distributed is not initialized.
        TypeError: if *overlap* is not a bool.
        ValueError: if *timeout* is not a positive number.
    """

    def __init__(
        self, *, timeout: float = AGREE_TIMEOUT, group: Any = None, overlap: bool = False
    ) -> None:
        if not isinstance(overlap, bool):
            msg = f"overlap must be a bool, got {overlap!r}"
            raise TypeError(msg)
        super().__init__(timeout=timeout, group=group)
        self.overlap = overlap
        self.overlapped = 0
        """Agreements that were launched during backward (the rest blocked at the safe point)."""
        self.waits: deque[float] = deque(maxlen=WAITS_KEPT)
        """Seconds recent safe points waited for an agreement launched during backward."""
        self.launches: deque[float] = deque(maxlen=WAITS_KEPT)
        """Seconds recent overlapped launches held the training thread during backward (the
        asynchronous ``all_reduce`` call: handing the collective to the backend's thread)."""
        self._spare: torch.Tensor | None = None
        """The overlapped agreement's vector, collected at the last safe point (reused)."""
        self._launcher: OutputGradLaunch | None = None
        self._engine: DecisionSource | None = None
        self._blocking_at: Callable[[int], bool] | None = None
        self._launched: _Launched | None
        self._deferred: tuple[DecidedAction, ...]
        self._deferred_noted: bool
        self._applied: tuple[bool, bool, bool]
        self._last_loss: float | None
        self._start_run()

    def _start_run(self) -> None:
        """Nothing launched, deferred or applied yet (a new run)."""
        self._launched = None
        self._deferred, self._deferred_noted = (), False
        self._applied = codec.NOTHING_APPLIED
        self._last_loss = None

    def _take_deferred(
        self, decisions: Sequence[DecidedAction], noted: bool
    ) -> tuple[tuple[DecidedAction, ...], bool]:
        """*decisions* after the ones deferred from the last safe point, and whether this rank
        had an incident (the deferred ones count); the deferred ones are taken."""
        carried = (*self._deferred, *decisions)
        any_noted = noted or self._deferred_noted or bool(self._deferred)
        self._deferred, self._deferred_noted = (), False
        return carried, any_noted

    @property
    def attached(self) -> bool:
        """True while the agreement is launched during backward (see :meth:`attach`)."""
        return self._launcher is not None

    def attach(
        self,
        model: nn.Module,
        engine: DecisionSource,
        *,
        blocking_at: Callable[[int], bool] | None = None,
        overlap: bool = True,
    ) -> bool:
        """Launch each step's agreement during *model*'s backward; True when that applies.

        It applies to a :class:`~torch.nn.parallel.DistributedDataParallel` model with
        ``overlap=True`` here and at construction; anything else (FSDP, DTensor, a plain module)
        keeps the blocking agreement. Call it on every rank alike; attaching again moves the
        hook. *model* is remembered either way (its join context is checked at each safe point).

        Args:
            model: the model the session trains.
            engine: the engine whose decisions are agreed (taken from it at the launch).
            blocking_at: steps that add a blocking round, because the probe checks rank-local
                state there (parameters, activations).
            overlap: False where the session must not overlap (a GradScaler, an overhead
                budget).

        Raises:
            TypeError: if *blocking_at* is neither callable nor None.
        """
        if blocking_at is not None and not callable(blocking_at):
            msg = f"blocking_at must be callable or None, got {blocking_at!r}"
            raise TypeError(msg)
        self.detach()
        self._start_run()
        self._model = model
        if not (self.overlap and overlap) or not isinstance(model, DistributedDataParallel):
            return False
        self._engine = engine
        self._blocking_at = blocking_at
        self._launcher = OutputGradLaunch(model, self._launch)
        return True

    def detach(self) -> None:
        """Go back to the blocking agreement (idempotent).

        An agreement launched during a backward that no safe point followed (the session ended
        between ``backward()`` and ``check_step``) is waited for first, within :attr:`timeout`:
        every rank launched it in the same backward, so it completes, and no collective is left
        in flight on the group (an agreement given as ``distributed=`` is detached at each
        session's end and serves the next session on the same group).
        """
        self._settle()
        if self._launcher is not None:
            self._launcher.remove()
        self._launcher = None
        self._engine = None

    def abort(self) -> None:
        """End the agreement on this rank's own error (see :meth:`BlockingAgreement.abort`): a
        launched agreement is not waited for (the peers may never match it); it fails with
        the group."""
        self._launched = None
        super().abort()

    def _settle(self) -> None:
        """Wait for the agreement launched during backward, if any (its outcome is unused)."""
        launched, self._launched = self._launched, None
        if launched is None or launched.work is None:
            return
        try:
            launched.work.wait(timeout=self._wait_timeout)
        except RuntimeError as exc:  # a peer left or hangs: the session is ending anyway
            _log.warning("agreement_unsettled", rank=self.rank, error=str(exc))

    def _agree(
        self, step: int, decisions: Sequence[DecidedAction], noted: bool, loss: float | None
    ) -> AgreedStep:
        launched, self._launched = self._launched, None
        if self._launcher is None:
            return self._agree_blocking(step, decisions, noted, loss)
        if launched is None:
            # Attached, but no backward since the last safe point: all in one blocking round.
            late, any_noted = self._take_deferred(decisions, noted)
            early_loss, self._last_loss = self._last_loss, loss
            agreed = self._agree_blocking(step, late, any_noted, early_loss)
            self._applied = _applied(agreed.decisions, agreed.noted)
            return agreed
        return self._agree_overlapped(step, launched, decisions, noted, loss)

    # -- the overlapped path -------------------------------------------------------------------

    def _launch(self, loss_grad_bad: bool) -> None:
        """Launch this step's agreement (from the backward hook; once per safe point)."""
        engine = self._engine
        if self._launched is not None or engine is None:
            return
        if loss_grad_bad and not engine.answers(_NON_FINITE_LOSS):
            loss_grad_bad = False  # no strategy acts on a non-finite loss (policy "observe")
        actions, noted = engine.take_for_agreement()
        carried, any_noted = self._take_deferred(actions, bool(noted))
        # The vector the last safe point collected is reused; one never collected may still be
        # written by its collective, so a new one is made then.
        vec = self._spare if self._spare is not None else codec.vector(self.world)
        self._spare = None
        codec.encode(
            vec,
            carried,
            any_noted,
            self.rank,
            self._last_loss,
            loss_grad_bad=loss_grad_bad,
            applied=self._applied,
            held=self.holds_state(),
        )
        started = time.perf_counter()
        try:
            work = dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        except RuntimeError as exc:  # a peer already left: said at the safe point
            self._launched = _Launched(None, vec, carried, loss_grad_bad, exc)
            return
        self.launches.append(time.perf_counter() - started)
        self._launched = _Launched(work, vec, carried, loss_grad_bad)

    def _agree_overlapped(
        self,
        step: int,
        launched: _Launched,
        late: Sequence[DecidedAction],
        noted: bool,
        loss: float | None,
    ) -> AgreedStep:
        started = time.perf_counter()
        if launched.error is not None:
            self._failed(_at(step, (*launched.carried, *late)), launched.error)
        try:
            launched.work.wait(timeout=self._wait_timeout)
        except RuntimeError as exc:  # gloo raises on a timeout or a peer that left
            self._failed(_at(step, (*launched.carried, *late)), exc)
        self.waits.append(time.perf_counter() - started)
        self.overlapped += 1
        agreed = launched.vec.tolist()
        self._spare = launched.vec
        mean = codec.mean_loss(agreed)
        early = codec.decode(agreed, launched.carried, step, self.world)
        mismatch = codec.digest_mismatch(agreed)
        if mismatch is not None:
            early = (*early, _diverged(step, mismatch, self.world))
        noted_now = bool(agreed[Slot.NOTED]) or bool(agreed[Slot.LOSS_GRAD_BAD])
        blocking = self._blocking_at is not None and self._blocking_at(step)
        now: tuple[DecidedAction, ...] = ()
        if blocking:
            # The probe checked rank-local state: the late decisions are agreed now, in full.
            extra = self._agree_blocking(step, late, noted, None)
            now = extra.decisions
            noted_now = noted_now or extra.noted
        elif late or noted:
            uncovered = loss is not None and not math.isfinite(loss) and not launched.loss_grad_bad
            now, later = split_late(late, local_loss_uncovered=uncovered)
            self._deferred = later
            self._deferred_noted = noted and not now
            noted_now = noted_now or bool(now)
        decisions = (*early, *now) if now else early
        self._applied = (
            _applied(decisions, noted_now) if decisions or noted_now else codec.NOTHING_APPLIED
        )
        self._last_loss = loss
        if agreed[Slot.ANY] or late:
            self.disagreements += int(not _same(launched.carried, agreed))
            local = _kinds((*launched.carried, *late))
            _log.info("ranks_agreed", step=step, rank=self.rank, local=local, overlapped=True)
        return AgreedStep(decisions=decisions, noted=noted_now, loss=mean)


def _applied(decisions: Sequence[DecidedAction], noted: bool) -> tuple[bool, bool, bool]:
    """What a safe point applies, for the next agreement's check: (skipped, clipped, noted)."""
    skip = any(isinstance(d.action, SkipStep | RestoreState) for d in decisions)
    clip = any(isinstance(d.action, ClipGradients) for d in decisions)
    return skip, clip, noted


def _diverged(step: int, mismatch: str, world: int) -> DecidedAction:
    reason = (
        f"the {world} ranks applied different decisions at the safe point before step {step} "
        f"(not all {mismatch}): their states may differ, so every rank stops here; "
        "run with RankAgreement(overlap=False) to agree every decision before applying it"
    )
    return agreed_stop(step, reason)


def agreement_for(distributed: bool | Agreement | None, timeout: float) -> Agreement | None:
    """The agreement a session uses: ``None`` alone, a :class:`RankAgreement` in a group.

    Args:
        distributed: ``None`` (default): agree when a process group of more than one rank is
            initialized; ``False``: never; ``True``: always (raises outside a group); or an
            :class:`Agreement` to use as it is.
        timeout: the agreement timeout in seconds.

    Raises:
        RuntimeError: if *distributed* is True and no process group is initialized.
        TypeError: if *distributed* is neither a bool, ``None`` nor an :class:`Agreement`.
    """
    if distributed is None:
        return RankAgreement(timeout=timeout) if distributed_active() else None
    if distributed is False:
        return None
    if distributed is True:
        if not (dist.is_available() and dist.is_initialized()):
            msg = (
                "distributed=True needs an initialized torch.distributed process group: call "
                "dist.init_process_group(...) (torchrun sets its environment) before the "
                "session starts, or leave distributed=None to agree only when one is"
            )
            raise RuntimeError(msg)
        return RankAgreement(timeout=timeout)
    if isinstance(distributed, Agreement):
        return distributed
    msg = f"distributed must be None, a bool or an Agreement, got {distributed!r}"
    raise TypeError(msg)
