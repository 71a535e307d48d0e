"""The blocking agreement: one MAX ``all_reduce`` per safe point on a dedicated gloo group.

At the safe point every rank encodes its pending decisions, whether it had an incident and its
loss in one small float64 vector (:mod:`.agreement_codec`) and reduces it with MAX, within a
timeout far below torch's 30-minute default; a rank that does not answer in time stops every
other one, naming its own decision. Also here: a retried call's agreement, the join context's
shadowing (a rank out of inputs matches the others' agreements), and the group's end (closed,
retired, aborted). :class:`~.agreement.RankAgreement` builds on it with the overlapped path.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Final, NoReturn, final

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook

from .._validate import positive_seconds
from ..diagnostics import get_logger
from ..exceptions import TrainingStopped
from . import agreement_codec as codec
from .actions import DecidedAction, Decision, Stop
from .agreement_codec import Slot
from .agreement_types import AgreedStep, CallAgreed

__all__ = ("WAITS_KEPT", "BlockingAgreement", "agreed_stop")

# The agreement's records keep the logger name they always had.
_log = get_logger("eventbus_debug.recovery.agreement")

WAITS_KEPT: Final = 4096
"""How many recent waits :attr:`RankAgreement.waits` keeps."""
_DECISION_SLOTS: Final = tuple(range(Slot.ANY, Slot.STOP_RANK + 1))
_retired: list[BlockingAgreement] = []
"""The agreements closed by their sessions (:meth:`RankAgreement.close`), whose groups are
destroyed when the next agreement creates its own: every rank is past its own close by then (the
new group connects them all), so none is still reducing on a group destroyed under it."""


class BlockingAgreement(Joinable):
    """The blocking part of :class:`~.agreement.RankAgreement` (see there: the arguments, the
    errors, the join context); built as a :class:`~.agreement.RankAgreement` only."""

    def __init__(self, *, timeout: float, group: Any) -> None:
        super().__init__()  # Joinable: no join context yet
        # the arguments first: a bad timeout is named wherever the agreement is built
        self.timeout = positive_seconds("timeout", timeout)
        if not (dist.is_available() and dist.is_initialized()):
            msg = "RankAgreement needs an initialized torch.distributed process group"
            raise RuntimeError(msg)
        self._wait_timeout = timedelta(seconds=self.timeout)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self._owns_group = group is None
        """Whether the agreement created its group (then :meth:`close` retires it)."""
        self._closed = False
        self.group = group if group is not None else self._new_group()
        if self._owns_group:
            _destroy_retired()
        self.agreements = 0
        """Agreements run (one per safe point)."""
        self.disagreements = 0
        """Agreements in which the ranks' pending decisions differed."""
        self.blocking_waits: deque[float] = deque(maxlen=WAITS_KEPT)
        """Seconds recent blocking agreements took (the collective, at the safe point)."""
        self._vec = codec.vector(self.world)
        self._model: nn.Module | None = None
        """The model the session trains (for the join context's checks)."""
        self._step = -1
        """The last step agreed (a joined rank shadows the steps after it)."""
        self.holds_state: Callable[[], bool] = _holds
        """Whether this rank holds a good state to restore (its safe point's snapshots say;
        a rank without one makes every rank skip a restore, or stop when it is required)."""

    def _new_group(self) -> Any:
        """A new gloo group over the default group's ranks (a collective: every rank builds its
        agreement, within :attr:`timeout`).

        Raises:
            RuntimeError: if some rank did not build its agreement in time (it opted out with
                ``distributed=False``, entered no session, or hangs).
        """
        try:
            return dist.new_group(backend="gloo", timeout=self._wait_timeout)
        except RuntimeError as exc:
            msg = (
                f"rank {self.rank} of {self.world} could not create the agreement's group within "
                f"{self.timeout:g} s ({exc}): every rank must enter its session (or build its "
                "RankAgreement) at the same point, with the same distributed= option; one "
                "with distributed=False on some ranks only never joins"
            )
            raise RuntimeError(msg) from exc

    def detach(self) -> None:
        """Go back to the blocking agreement (idempotent): nothing to undo here
        (:class:`~.agreement.RankAgreement` removes its backward hook)."""

    def close(self) -> None:
        """End the agreement with its session: no collective, idempotent.

        The backward hook is removed (:meth:`detach`) and a group the agreement created is
        retired: destroyed when the next :class:`RankAgreement` creates its own, once every
        rank is past this close. A session calls it at its exit for the agreement it built, so
        a job that enters one session per epoch holds one agreement group, not one per epoch
        (each held sockets and threads until the process group was destroyed). An agreement
        passed as ``distributed=`` is only detached: pass the same one to every session.
        """
        self.detach()
        self._model = None  # a retired agreement does not keep the model (nor its group) alive
        if self._owns_group and not self._closed:
            _retired.append(self)
        self._closed = True

    def abort(self) -> None:
        """End the agreement because this rank's session ended with an error: its group, if
        the agreement created it, is destroyed at once (no collective), so the peers waiting
        in their next agreement fail now (the connection closes) instead of after
        :attr:`timeout`, and stop together. Idempotent; a closed agreement refuses to agree.
        """
        self.detach()
        if self._owns_group and self.group is not None:
            group, self.group = self.group, None
            with contextlib.suppress(ValueError, RuntimeError):  # gone with the default group
                dist.destroy_process_group(group)
        self._closed = True

    def _check_open(self) -> None:
        """Refuse to agree once closed (its group may be destroyed: ``None`` would mean WORLD).

        Raises:
            RuntimeError: if :meth:`close` was called.
        """
        if self._closed:
            msg = (
                "this RankAgreement was closed when its session ended; a new session builds its "
                "own (or pass one RankAgreement as distributed= to every session)"
            )
            raise RuntimeError(msg)

    def agree_call(self, *, failed: bool, fatal: bool, batch_size: int | None) -> CallAgreed:
        """Agree on the outcome of one attempt of a retried call (one small collective).

        Every rank calls it after every attempt of a :class:`~eventbus_debug.recovery.Retrying`
        block (the retry does, when its engine has an agreement), so an OOM on one rank makes
        every rank re-run with the same, smallest batch size and step counts stay equal.

        Raises:
            TrainingStopped: if the other ranks do not answer within :attr:`timeout`.
            RuntimeError: if the agreement was closed (its session ended).
        """
        self._check_open()
        v = torch.tensor(
            [float(failed), float(fatal), -float(batch_size) if batch_size else -math.inf],
            dtype=torch.float64,
        )
        self._reduce(v, lambda: f"a retried call (this rank failed: {failed})")
        any_failed, any_fatal, neg_batch = v.tolist()
        return CallAgreed(
            failed=bool(any_failed),
            fatal=bool(any_fatal),
            batch_size=int(-neg_batch) if math.isfinite(neg_batch) else None,
        )

    def agree(
        self,
        step: int,
        decisions: Sequence[DecidedAction],
        noted: bool,
        /,
        *,
        loss: float | None = None,
    ) -> AgreedStep:
        """Agree on *step*'s decisions, and average the loss, with every rank: one collective.

        Raises:
            TrainingStopped: if the other ranks do not answer within :attr:`timeout` (this
                rank's own pending decisions are named).
            RuntimeError: if the agreement was closed (its session ended), or the join
                context does not shadow it.
        """
        self._check_open()
        self._check_join()
        self._step = step
        self.agreements += 1
        return self._agree(step, decisions, noted, loss)

    def _agree(
        self, step: int, decisions: Sequence[DecidedAction], noted: bool, loss: float | None
    ) -> AgreedStep:
        return self._agree_blocking(step, decisions, noted, loss)

    # -- uneven inputs: torch.distributed.algorithms.join ----------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a rank out of inputs runs while others train: it shadows their agreements."""
        return _ShadowAgreement(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the join context's own collectives (the model's, listed first)."""
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        """The join context's process group: the model's (the agreement's own is separate)."""
        return getattr(self._model, "process_group", None) or dist.group.WORLD

    def _check_join(self) -> None:
        """Refuse a join context that does not shadow the agreement (it would stall, then stop).

        Raises:
            RuntimeError: if the model is in a join context without the agreement, or the
                agreement is listed before the model.
        """
        mine = self._join_config
        if mine.enable and mine.is_first_joinable:
            msg = (
                "the agreement must be listed after the model in the join context: "
                "Join([model, session.agreement])"
            )
            raise RuntimeError(msg)
        theirs = getattr(self._model, "_join_config", None)
        if theirs is not None and theirs.enable and not mine.enable:
            msg = (
                "the model is in a join context (model.join() or Join([model])) that does not "
                "shadow the session's agreement: a rank out of inputs would leave the others "
                "waiting at the next safe point. Use Join([model, session.agreement]), or "
                "Session(..., distributed=False), or give every rank as many batches"
            )
            raise RuntimeError(msg)

    def _shadow(self) -> None:
        """Match one agreement of the ranks still training (MAX's identity: all ``-inf``).

        It runs after the model's join hook, as the others agree after DDP's backward; a
        retried call's agreement (before backward) is not shadowed.
        """
        self._step += 1
        step = self._step
        v = torch.full((codec.vector(self.world).numel(),), -math.inf, dtype=torch.float64)
        self._reduce(v, lambda: _joined(step))

    # -- the blocking path ---------------------------------------------------------------------

    def _agree_blocking(
        self, step: int, decisions: Sequence[DecidedAction], noted: bool, loss: float | None
    ) -> AgreedStep:
        v = codec.encode(
            self._vec, decisions, noted, self.rank, loss, step=step, held=self.holds_state()
        )
        started = time.perf_counter()
        self._reduce(v, lambda: _at(step, decisions))
        self.blocking_waits.append(time.perf_counter() - started)
        agreed = v.tolist()
        if agreed[Slot.ANY] or decisions:
            if not _same(decisions, agreed):
                self.disagreements += 1
            local = _kinds(decisions)
            _log.info("ranks_agreed", step=step, rank=self.rank, local=local, overlapped=False)
        decided = codec.decode(agreed, decisions, step, self.world)
        apart = codec.steps_apart(agreed)
        if apart is not None:
            decided = (*decided, _steps_apart(step, apart, self.world))
        return AgreedStep(
            decisions=decided,
            noted=bool(agreed[Slot.NOTED]),
            loss=codec.mean_loss(agreed),
        )

    def _reduce(self, tensor: torch.Tensor, what: Callable[[], str]) -> None:
        """All-reduce *tensor* with MAX; *what* names what was being agreed if that fails."""
        started = time.monotonic()
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as exc:  # gloo raises on a timeout or a peer that left
            self._failed(what(), exc, waited=time.monotonic() - started)

    def _failed(self, what: str, exc: RuntimeError, *, waited: float | None = None) -> NoReturn:
        if waited is not None and waited < 0.9 * self.timeout:
            # a peer's connection closed (it crashed, or its session ended with an error)
            when = f"after {waited:.1f} s (the timeout is {self.timeout:g} s)"
        else:
            when = f"within {self.timeout:g} s"
        msg = (
            f"rank {self.rank} of {self.world} could not agree on {what} {when}: another rank "
            f"stopped, crashed or hangs ({exc}). If a rank may pause longer between two steps "
            "(a checkpoint, an evaluation), raise the timeout: "
            "Session(..., distributed=RankAgreement(timeout=SECONDS))"
        )
        _log.error("agreement_failed", rank=self.rank, what=what)
        self.detach()
        raise TrainingStopped(msg) from exc


@final
class _ShadowAgreement(JoinHook):
    """A joined rank's hook: one shadowed agreement per training iteration of the others."""

    def __init__(self, agreement: BlockingAgreement) -> None:
        self.agreement = agreement

    def main_hook(self) -> None:
        self.agreement._shadow()


def _steps_apart(step: int, apart: tuple[int, int], world: int) -> DecidedAction:
    """The stop every rank applies when the ranks passed different steps to one safe point."""
    reason = (
        f"the {world} ranks called check_step with different step numbers at the same safe "
        f"point (from {apart[0]} to {apart[1]}; this rank: {step}): their decisions, snapshots "
        "and logs would not line up, so every rank stops here; pass the same step on every rank"
    )
    return agreed_stop(step, reason)


def _holds() -> bool:
    return True  # no safe point told otherwise: restores are not this agreement's concern


def agreed_stop(step: int, reason: str) -> DecidedAction:
    """The stop every rank applies at *step* for *reason* (decided by the agreement itself)."""
    return DecidedAction(
        decision=Decision(action=Stop(), reason=reason),
        strategy="agreed",
        trigger_kind="agreement",
        trigger_seq=-1,
        step=step,
    )


def _joined(step: int) -> str:
    """What a joined rank's failed shadow was about."""
    return f"step {step} (this rank is out of inputs: it decided nothing)"


def _kinds(decisions: Sequence[DecidedAction]) -> str:
    """The kinds of *decisions*, for the log (``"nothing"`` when there are none)."""
    return ", ".join(d.kind.value for d in decisions) or "nothing"


def _at(step: int, decisions: Sequence[DecidedAction]) -> str:
    """What a failed agreement was about: *step* and this rank's own *decisions*."""
    return f"step {step} (this rank decided: {_kinds(decisions)})"


def _same(local: Sequence[DecidedAction], agreed: Sequence[float]) -> bool:
    """Whether this rank's own decisions are what the group agreed (for the statistics)."""
    mine = codec.encode(codec.vector(1), local, False, 0).tolist()
    return all(mine[s] == agreed[s] for s in _DECISION_SLOTS)


def _destroy_retired() -> None:
    """Destroy the groups of the agreements closed so far (not a collective)."""
    while _retired:
        agreement = _retired.pop()
        group, agreement.group = agreement.group, None  # its sockets close once unreferenced
        # Gone already when the default group was destroyed since (a ValueError then).
        with contextlib.suppress(ValueError, RuntimeError):
            dist.destroy_process_group(group)
