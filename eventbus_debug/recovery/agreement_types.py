"""What an agreement is: the :class:`Agreement` protocol, its answers and its decision source.

The safe point, the engine and the session speak to an agreement through these types alone;
:class:`~.agreement.RankAgreement` is the one on torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..events import Anomaly
from .actions import DecidedAction

__all__ = ("AgreedStep", "Agreement", "CallAgreed", "DecisionSource")


class DecisionSource(Protocol):
    """What an overlapped agreement takes its decisions from (the recovery engine)."""

    def take_for_agreement(self) -> tuple[tuple[DecidedAction, ...], int]:
        """Remove and return the pending step decisions and the count of incidents noted."""
        ...

    def answers(self, incident: Anomaly) -> bool:
        """Whether some strategy is asked about incidents like *incident*."""
        ...


@dataclass(frozen=True, slots=True)
class AgreedStep:
    """What the group agreed at one safe point.

    Attributes:
        decisions: the decisions every rank applies (the same on every rank).
        noted: True when some rank had an incident this step (no rank counts it as good).
        loss: the step's loss averaged over the ranks (``None`` when no rank gave one); the
            probe judges loss spikes on it.
    """

    decisions: tuple[DecidedAction, ...]
    noted: bool
    loss: float | None = None


@dataclass(frozen=True, slots=True)
class CallAgreed:
    """What the group agreed after one attempt of a retried call.

    Attributes:
        failed: some rank's attempt failed and will be retried: every rank re-runs.
        fatal: some rank's attempt failed for good (no strategy, or exhausted): every rank
            stops.
        batch_size: the smallest batch size any rank will use next (``None``: none set).
    """

    failed: bool
    fatal: bool
    batch_size: int | None


@runtime_checkable
class Agreement(Protocol):
    """Turns this rank's pending decisions into the decisions every rank applies."""

    def agree(
        self,
        step: int,
        decisions: Sequence[DecidedAction],
        noted: bool,
        /,
        *,
        loss: float | None = None,
    ) -> AgreedStep:
        """Agree with the other ranks; called at every safe point on every rank."""
        ...
