"""The incident table behind a :class:`RunSummary`: its rows, one incident merged over the ranks
that had it, and the recovery chain linked across rows.

An incident is one row naming every rank that had it (counted once) when the ranks logged the
same thing: the same step, the same kind, the same identity (the fields that say what happened,
:data:`_IDENTITY`: a non-finite tensor's role and names, a spike's rule...; never a measured
value, which differs between ranks) and the same occurrence of that incident on each rank. A
recovery decision's identity is its action, strategy and its trigger's row; an applied action's,
its decision's row: each links to the incident that caused it. Every map is bounded: the oldest
entries go first, as their rows leave the table.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from enum import Enum
from typing import Final, TypeAlias

from eventbus_debug.events import Event, RecoveryApplied, RecoveryDecided, SessionEnded
from eventbus_debug.events.describe import describe

from ..summary import IncidentRow

_MAX_LINKS: Final = 4096
_MAX_PENDING: Final = 64
_MAX_GROUPS: Final = 4096
"""How many recent incidents are remembered for recognising the same incident on another rank
(an incident at the same step, of the same kind and identity, the same occurrence of it on each
rank)."""

_FIRST_SHARE: Final = 10
"""One row in this many of those kept is one of the run's first incidents: on a run with
more incidents than the table keeps, the first ones (where the trouble began: the first NaN,
the first explosion of thousands) stay listed beside the most recent."""

_Key: TypeAlias = tuple[int, str, int, int]
"""An incident's step, kind, identity (a hash of :func:`_identity`) and occurrence on its rank:
the same on every rank that had it."""

_HEADER: Final = frozenset(("seq", "time_ns", "step", "rank", "source", "severity"))

_IDENTITY: Final[dict[str, tuple[str, ...]]] = {
    "non_finite_detected": ("role", "names"),
    "loss_spiked": ("rule",),
    "gradient_exploded": ("rule",),
    "gradient_vanished": ("layers", "all_zero"),
    "anomaly_localized": ("module", "phase", "role", "parameter"),
    "autograd_anomaly_detected": ("backward_fn",),
    "error_raised": ("error_type", "category", "message"),
    "scaler_in_trouble": (),
    "sample_skipped": ("index", "error_type"),
    "memory_leak_suspected": ("resource",),
    "resource_threshold_exceeded": ("metric",),
    "step_skipped": (),  # a skipped step is one row, whatever each rank's own reason
    "session_ended": ("reason",),
    "sink_failed": ("sink", "error_type", "event_kind"),
    "sink_disabled": ("sink",),
    "events_dropped": ("sink",),
    "events_undelivered": ("sink", "phase"),
}
"""The fields that say which incident an event of each kind is: ranks that logged the same
values had the same incident. Measurements (losses, norms, counts) are left out: they differ
between ranks that had the same incident. Other kinds: their text, flag and enum fields."""

_DEFAULT_IDENTITY: dict[type[Event], tuple[str, ...]] = {}
"""The non-header fields of each event class without an :data:`_IDENTITY` entry."""


class _RowState:
    """An incident row being built: its first rank's row and every rank that had it."""

    __slots__ = ("ranks", "row")

    def __init__(self, row: IncidentRow) -> None:
        self.row = row
        self.ranks = [row.rank]


class _IncidentRows:
    """The run's first and most recent incident rows, merged over ranks and linked into
    recovery chains.

    A base of :class:`RunAggregator`, which decides what is an incident and calls
    :meth:`_merge` then :meth:`_list` for each, and the links for recovery events.
    """

    def _clear_rows(self, max_incidents: int) -> None:
        """Forget every row, keeping at most *max_incidents* from now on: the run's first
        tenth of them and the most recent rest."""
        self._incidents_total = 0
        self._first_rows: list[_RowState] = []
        self._first_max = max_incidents // _FIRST_SHARE
        self._incidents: deque[_RowState] = deque(maxlen=max_incidents - self._first_max)
        # the same incident on several ranks: (rank, step, kind, identity) -> occurrences on
        # that rank; (step, kind, identity, occurrence) -> its row; (rank, seq) of a merged
        # event -> its row's; (rank, seq) of an incident -> its key (a decision's trigger)
        self._occurrences: dict[tuple[int, int, str, int], int] = {}
        self._groups: dict[_Key, _RowState] = {}
        self._alias: dict[tuple[int, int], tuple[int, int]] = {}
        self._keys: dict[tuple[int, int], _Key] = {}
        # recovery chain: (rank, seq) -> seqs it led to; (rank, action) -> undone decisions
        self._led_to: dict[tuple[int, int], list[int]] = {}
        self._pending: dict[tuple[int, str], deque[int]] = {}

    def _merge(self, event: Event) -> tuple[_Key | None, bool]:
        """The key of incident *event* (``None`` without a step) and whether it is new: another
        rank's copy of an incident already listed joins that row and is counted once."""
        step = event.step
        if step is None:
            return None, True
        kind = event.kind
        identity = _identity_hash(self._identity(event))
        rank = event.rank
        key = (step, kind, identity, self._occurrence(rank, step, kind, identity))
        if event.seq >= 0:
            keys = self._keys
            if len(keys) >= _MAX_LINKS:
                del keys[next(iter(keys))]
            keys[(rank, event.seq)] = key
        return key, not self._join_group(event, key)

    def _identity(self, event: Event) -> tuple[object, ...]:
        """What *event* is, the same on every rank that had the same incident: its fields of
        :data:`_IDENTITY` (a decision: its action, strategy and trigger's key; an applied
        action: its decision's key)."""
        if isinstance(event, RecoveryDecided):
            trigger = self._keys.get((event.rank, event.trigger_seq))
            if trigger is None:  # its trigger was not listed (or is gone): the decision's text
                return (event.action, event.strategy, event.trigger_kind, event.reason)
            return (event.action, event.strategy, trigger)
        if isinstance(event, RecoveryApplied):
            pending = self._pending.get((event.rank, event.action.value))
            decision = self._keys.get((event.rank, pending[0])) if pending else None
            if decision is None:
                return (event.action, event.outcome, event.detail)
            return (event.action, event.outcome, decision)
        names = _IDENTITY.get(event.kind)
        if names is not None:
            return tuple(getattr(event, name, None) for name in names)
        fields = _DEFAULT_IDENTITY.get(type(event))
        if fields is None:
            fields = _DEFAULT_IDENTITY[type(event)] = _default_identity(event)
        # text, flags, enums and tuples (names, rules, roles), not measurements
        return tuple(
            (name, value)
            for name in fields
            if isinstance(value := getattr(event, name, None), (str, bool, Enum, tuple))
        )

    def _list(self, event: Event, key: _Key | None, caused_by: int | None) -> None:
        """Add a row for the new incident *event* (*key* from :meth:`_merge`)."""
        self._incidents_total += 1
        state = _RowState(
            IncidentRow(
                seq=event.seq,
                time_ns=event.time_ns,
                step=event.step,
                rank=event.rank,
                kind=event.kind,
                severity=event.severity.value,
                source=event.source,
                message=_message(event),
                caused_by=caused_by,
            )
        )
        if len(self._first_rows) < self._first_max:
            self._first_rows.append(state)
        else:
            self._incidents.append(state)
        if key is not None:
            groups = self._groups
            if len(groups) >= _MAX_GROUPS and key not in groups:
                del groups[next(iter(groups))]
            groups[key] = state

    def _occurrence(self, rank: int, step: int, kind: str, identity: int) -> int:
        """How many incidents of *kind* and *identity* at *step* *rank* had before this one
        (bounded memory)."""
        occurrences = self._occurrences
        key = (rank, step, kind, identity)
        n = occurrences.get(key, 0)
        if not n and len(occurrences) >= _MAX_GROUPS:
            del occurrences[next(iter(occurrences))]
        occurrences[key] = n + 1
        return n

    def _join_group(self, event: Event, key: _Key) -> bool:
        """Whether another rank already listed this incident (*key*: its step, kind, identity
        and occurrence on the rank); its row then names this rank too."""
        group = self._groups.get(key)
        rank = event.rank
        if group is None or rank in group.ranks:
            return False
        group.ranks.append(rank)
        if event.seq >= 0 and group.row.seq >= 0:
            alias = self._alias
            if len(alias) >= _MAX_LINKS:
                del alias[next(iter(alias))]
            alias[(rank, event.seq)] = (group.row.rank, group.row.seq)
        return True

    def _link(self, rank: int, source_seq: int, target_seq: int) -> int | None:
        """Link *source_seq* to *target_seq* (both of *rank*) on the rows that list them (a
        merged copy's row is its first rank's); the source's seq on that row, or ``None`` when
        the two rows are not of the same rank."""
        alias = self._alias
        src_rank, src = alias.get((rank, source_seq), (rank, source_seq))
        dst_rank, dst = alias.get((rank, target_seq), (rank, target_seq))
        if src_rank != dst_rank:
            return None
        links = self._led_to
        key = (src_rank, src)
        targets = links.get(key)
        if targets is None:
            if len(links) >= _MAX_LINKS:
                del links[next(iter(links))]  # the oldest chain: its rows left the table
            targets = links[key] = []
        if len(targets) < _MAX_PENDING and dst not in targets:
            targets.append(dst)
        return src

    def _link_decision(self, event: RecoveryDecided, action: str) -> int | None:
        if event.seq < 0:
            return None
        pending = self._pending.get((event.rank, action))
        if pending is None:
            pending = self._pending[(event.rank, action)] = deque(maxlen=_MAX_PENDING)
        pending.append(event.seq)
        if event.trigger_seq < 0:
            return None
        return self._link(event.rank, event.trigger_seq, event.seq)

    def _link_applied(self, event: RecoveryApplied) -> int | None:
        pending = self._pending.get((event.rank, event.action.value))
        if not pending or event.seq < 0:
            return None
        decision = pending.popleft()
        return self._link(event.rank, decision, event.seq)

    def _linked_incidents(self) -> tuple[IncidentRow, ...]:
        """The rows kept, in order: the run's first ones, then the most recent."""
        links = self._led_to
        out = []
        for state in itertools.chain(self._first_rows, self._incidents):
            row = state.row
            led = links.get((row.rank, row.seq))
            out.append(
                dataclasses.replace(
                    row,
                    led_to=row.led_to if led is None else tuple(led),
                    ranks=tuple(sorted(state.ranks)),
                )
            )
        return tuple(out)


def _default_identity(event: Event) -> tuple[str, ...]:
    """The fields of an event class without an :data:`_IDENTITY` entry, less the header."""
    return tuple(f.name for f in dataclasses.fields(event) if f.name not in _HEADER)


def _identity_hash(values: tuple[object, ...]) -> int:
    try:
        return hash(values)
    except TypeError:  # a tuple field holding something unhashable
        return hash(repr(values))


def end_reason(event: SessionEnded) -> str:
    """How a session ended, in words: its reason, and for a stop why (``"stopped: ..."``)."""
    return f"{event.reason}: {event.detail}" if event.detail else event.reason


def _message(event: Event) -> str:
    if isinstance(event, SessionEnded):  # listed when it did not complete: say why
        return f"session {event.name!r} ended after {event.steps} steps: {end_reason(event)}"
    return describe(event)
