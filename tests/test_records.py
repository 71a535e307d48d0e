"""fast_init: the faster __init__ of frozen, slotted records keeps the dataclass's behaviour."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import pytest

from eventbus_debug._records import fast_init
from eventbus_debug.probes.step import StepVerdict
from eventbus_debug.recovery.safepoint import StepDecision
from eventbus_debug.session import Verdict

_COUNTER = 41


def _next() -> int:
    return _COUNTER + 1


@fast_init
@dataclass(frozen=True, slots=True, kw_only=True)
class _Record:
    name: str
    count: int = 3
    tags: tuple[str, ...] = ()
    made: int = field(default_factory=time.time_ns)
    items: list[int] = field(default_factory=list)


def test_fast_init_keeps_defaults_factories_and_immutability() -> None:
    """Defaults, factories (a new list each time) and frozenness behave as the dataclass's."""
    a, b = _Record(name="a"), _Record(name="b", count=5, items=[1])
    assert (a.count, a.tags, a.items, b.count, b.items) == (3, (), [], 5, [1])
    assert a.items is not _Record(name="c").items
    assert a.made > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.count = 4  # type: ignore[misc]
    assert a == _Record(name="a", made=a.made)
    assert type(a).__init__.__qualname__ == "_Record.__init__"


def test_fast_init_refuses_positional_and_missing_arguments() -> None:
    """The signature stays keyword-only, with its required fields required."""
    with pytest.raises(TypeError):
        _Record("a")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Record()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Record(name="a", colour="red")  # type: ignore[call-arg]


def test_fast_init_reads_live_globals() -> None:
    """A factory named in *live* is replaced by a global of the namespace, read at each call."""
    global _COUNTER

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Counted:
        n: int = field(default_factory=_next)

    fast_init(Counted, live={_next: "_COUNTER"}, namespace=globals())
    assert Counted().n == 41
    _COUNTER = 7
    try:
        assert Counted().n == 7
        assert Counted(n=1).n == 1
    finally:
        _COUNTER = 41


def test_fast_init_leaves_classes_it_cannot_speed_up() -> None:
    """A __post_init__, a positional field or a non-slotted class keep the dataclass __init__."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Checked:
        n: int

        def __post_init__(self) -> None:
            if self.n < 0:
                raise ValueError("n")

    @dataclass(frozen=True, slots=True)
    class Positional:
        n: int

    @dataclass(frozen=True, kw_only=True)
    class Unslotted:
        n: int

    for cls in (Checked, Positional, Unslotted):
        before = cls.__init__
        assert fast_init(cls) is cls and cls.__init__ is before
    with pytest.raises(ValueError, match="n"):
        Checked(n=-1)
    assert fast_init(int) is int  # not a dataclass at all


def test_the_per_step_records_use_it() -> None:
    """The records built on every step are fast and still frozen, keyword-only values."""
    probe = StepVerdict(step=2, loss=1.5)
    verdict = Verdict(step=2, probe=probe, should_step=True)
    decision = StepDecision(step=2, should_step=False)
    assert (verdict.loss, verdict.finite, bool(decision)) == (1.5, True, False)
    for record in (probe, verdict, decision):
        assert type(record).__init__.__module__ == type(record).__module__
        assert "_set0" in type(record).__init__.__code__.co_freevars
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.step = 3  # type: ignore[misc]
