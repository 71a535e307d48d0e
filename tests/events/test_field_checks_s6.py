"""Event fields hold values of their declared types: the constructor refuses the others, named.

The rule is the log reader's (the log is the canonical record): whatever a constructor accepts,
the writer writes and the reader reads back; what the reader would refuse, the constructor
refuses with a TypeError naming the class and the field.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from collections.abc import Mapping
from dataclasses import field
from typing import Any, ClassVar, Literal

import numpy as np
import pytest
import torch

from eventbus_debug import Event, decode_event, encode_event, event_type
from eventbus_debug._records import FieldCheck, fast_init
from eventbus_debug.events import (
    ErrorRaised,
    EventsDropped,
    GradientExploded,
    LossSpiked,
    NonFiniteDetected,
    RecoveryAction,
    RecoveryDecided,
    Severity,
    SinkFailed,
    StepChecked,
    StepCompleted,
    TensorRole,
    event_types,
)
from eventbus_debug.events._checks import field_rule, invalid_field
from eventbus_debug.events.recovery import ScaleLR
from eventbus_debug.exceptions import EventDecodeError
from eventbus_debug.testing import make_sample_event

LIBRARY_KINDS = sorted(
    k for k, c in event_types().items() if c.__module__.startswith("eventbus_debug.")
)


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Point:
    x: float
    label: str = ""


@event_type
class _AllTypes(Event):
    """One field of every kind of annotation the reader interprets."""

    kind: ClassVar[str] = "tests.s6.all_types"
    f: float = 0.0
    of: float | None = None
    i: int = 0
    oi: int | None = None
    s: str = ""
    b: bool = False
    colour: Colour = Colour.RED
    either: int | str = 0
    lit: Literal["a", "b"] = "a"
    names: tuple[str, ...] = ()
    pair: tuple[str, float] = ("a", 1.0)
    nested: tuple[tuple[str, float], ...] = ()
    numbers: Mapping[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    point: Point | None = None
    anything: Any = None
    thing: object = None


class TestConstructorRefusesWrongTypes:
    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"f": "0.5"}, r"_AllTypes\.f must be a float, got str '0\.5'"),
            ({"f": True}, r"_AllTypes\.f must be a float, got bool True"),
            ({"of": "x"}, r"_AllTypes\.of must be a float or None, got str 'x'"),
            ({"i": 1.5}, r"_AllTypes\.i must be an int, got float 1\.5"),
            ({"i": True}, r"_AllTypes\.i must be an int, got bool True"),
            ({"oi": "2"}, r"_AllTypes\.oi must be an int or None, got str '2'"),
            ({"s": 3}, r"_AllTypes\.s must be a str, got int 3"),
            ({"b": 1}, r"_AllTypes\.b must be a bool, got int 1"),
            ({"colour": "red"}, r"_AllTypes\.colour must be a Colour, got str 'red'"),
            ({"either": 1.5}, r"_AllTypes\.either must be an int or a str, got float"),
            ({"lit": "c"}, r"_AllTypes\.lit must be one of \['a', 'b'\], got str 'c'"),
            ({"names": ("a", 3)}, r"_AllTypes\.names must be a tuple of str, item 1: got int 3"),
            ({"names": "ab"}, r"_AllTypes\.names must be a tuple of str, got str 'ab'"),
            ({"pair": ("a",)}, r"_AllTypes\.pair must be a tuple of 2 \(str, float\), got 1 item"),
            ({"nested": (("a", "b"),)}, r"_AllTypes\.nested .* item 0: item 1: got str 'b'"),
            ({"numbers": {"w": "x"}}, r"_AllTypes\.numbers .* value of 'w': got str 'x'"),
            ({"numbers": {1: 1.0}}, r"_AllTypes\.numbers .* key 1: got int, keys must be str"),
            ({"numbers": [("w", 1.0)]}, r"_AllTypes\.numbers must be a dict of str to float"),
            ({"counts": {"a": 1.0}}, r"_AllTypes\.counts .* value of 'a': got float 1\.0"),
            ({"point": Point(x="1")}, r"_AllTypes\.point must be a Point or None, its x must"),  # type: ignore[arg-type]
            ({"point": {"x": 1.0}}, r"_AllTypes\.point must be a Point or None, got dict"),
        ],
    )
    def test_a_wrong_type_is_a_type_error_naming_the_field(
        self, kwargs: dict[str, Any], message: str
    ) -> None:
        """Each declared type refuses what the reader would refuse, naming class and field."""
        with pytest.raises(TypeError, match=message):
            _AllTypes(**kwargs)

    def test_an_int_beyond_64_bits_is_a_value_error(self) -> None:
        """The log's ints are 64-bit: a larger one is refused with a ValueError, named."""
        with pytest.raises(ValueError, match=r"_AllTypes\.f must be a float, got 1180\d+, outside"):
            _AllTypes(f=2**70)
        with pytest.raises(ValueError, match=r"_AllTypes\.numbers .*outside the 64-bit range"):
            _AllTypes(numbers={"a": 2**70})

    @pytest.mark.parametrize("value", [np.float64(0.5), np.float32(0.5), torch.tensor(0.5)])
    def test_tensors_and_numpy_scalars_get_the_conversion_hint(self, value: object) -> None:
        """A tensor or NumPy scalar (JSON cannot carry them) names .item() as the fix."""
        with pytest.raises(TypeError, match=r"LossSpiked\.loss must be a float, got .*\.item\(\)"):
            LossSpiked(loss=value, running_mean=1.0, ratio=1.0, rule="spike")  # type: ignore[arg-type]

    def test_library_events_refuse_the_audit_cases(self) -> None:
        """The new-user audit's cases: a string norm, an int context value, a string count."""
        with pytest.raises(TypeError, match=r"GradientExploded\.total_norm must be a float"):
            GradientExploded(step=3, total_norm="big", threshold=10.0)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"ErrorRaised\.context .* value of 'batch'"):
            ErrorRaised(error_type="E", message="m", context={"batch": 3})  # type: ignore[dict-item]
        with pytest.raises(TypeError, match=r"EventsDropped\.dropped must be an int"):
            EventsDropped(sink="s", dropped="2", total_dropped=2)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"NonFiniteDetected\.role must be a TensorRole"):
            NonFiniteDetected(role="loss")  # type: ignore[arg-type]
        broken = ScaleLR(factor=0.5)
        object.__setattr__(broken, "factor", "half")  # its own check ran at construction
        with pytest.raises(TypeError, match=r"RecoveryDecided\.decided .*its factor must"):
            RecoveryDecided(
                action=RecoveryAction.SCALE_LR,
                reason="r",
                strategy="s",
                trigger_kind="k",
                trigger_seq=1,
                decided=broken,
            )

    def test_replace_is_checked_too(self) -> None:
        """dataclasses.replace builds through the constructor: the same check."""
        event = SinkFailed(sink="s", error_type="E", message="m")
        with pytest.raises(TypeError, match=r"SinkFailed\.message must be a str"):
            dataclasses.replace(event, message=3)  # type: ignore[arg-type]


class TestConstructorAcceptsWhatTheReaderReads:
    def test_valid_values_pass_and_round_trip(self) -> None:
        """Ints for floats, lists for tuples, dict subclasses, NaN: accepted and read back."""
        event = _AllTypes(
            f=3,
            of=math.nan,
            i=2**63,
            oi=None,
            s="x",
            b=True,
            either="two",
            lit="b",
            names=["a", "b"],  # type: ignore[arg-type]
            pair=["a", 2],  # type: ignore[arg-type]
            nested=(("a", 1.0),),
            numbers={"w": math.inf, "v": 1},
            counts={"a": -1},
            point=Point(x=1, label="p"),
            anything={"free": [1, "form"]},
            thing=None,
        )
        back = decode_event(encode_event(event))
        assert isinstance(back, _AllTypes)
        assert back.f == 3.0 and math.isnan(back.of or 0.0) and back.i == 2**63
        assert back.names == ("a", "b") and back.pair == ("a", 2.0)
        assert back.numbers["w"] == math.inf and back.point == Point(x=1.0, label="p")

    def test_unchecked_annotations_take_anything(self) -> None:
        """Any and object fields are not checked at construction (the writer still is)."""
        event = _AllTypes(anything={1, 2}, thing=object())
        assert invalid_field(event) is None

    @pytest.mark.parametrize("kind", LIBRARY_KINDS)
    def test_every_registered_event_samples_valid(self, kind: str) -> None:
        """The sample of every registered class passes its own rules and round-trips."""
        event = make_sample_event(event_types()[kind])
        assert invalid_field(event) is None
        assert decode_event(encode_event(event)) == event

    @pytest.mark.parametrize("kind", LIBRARY_KINDS)
    def test_decoded_events_pass_the_constructor(self, kind: str) -> None:
        """What the reader builds is always valid: decode goes through the checked constructor."""
        line = encode_event(make_sample_event(event_types()[kind]))
        assert invalid_field(decode_event(line)) is None


@event_type
class _Later(Event):
    """Its field's type is defined below it: not resolvable when @event_type runs."""

    kind: ClassVar[str] = "tests.s6.later"
    value: _DefinedLater | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _DefinedLater:
    x: float


CHECKED_FIELDS = [
    "f", "of", "i", "oi", "s", "b", "colour", "either", "lit", "names", "pair", "nested",
    "numbers", "counts", "point",
]  # fmt: skip


class TestRulesAgreeWithTheReader:
    """For each annotation and candidate value: the rule accepts it iff the log reads it back."""

    CANDIDATES: ClassVar[list[object]] = [
        0.5,
        math.nan,
        3,
        2**64,
        -(2**63) - 1,
        True,
        "s",
        "a",
        None,
        Colour.RED,
        ("a", 1.0),
        ["a", "b"],
        (("a", 1.0),),
        {"k": 1.0},
        {"k": "v"},
        {"k": 1},
        {1: "v"},
        Point(x=1.0),
        np.float64(1.0),
    ]

    @pytest.mark.parametrize("name", CHECKED_FIELDS)
    def test_what_the_rule_accepts_is_read_back(self, name: str) -> None:
        """Accepted by the rule => written by the encoder and decoded by the reader."""
        rule = field_rule(typing.get_type_hints(_AllTypes)[name])
        assert rule is not None
        accepted = 0
        for value in self.CANDIDATES:
            if rule.check(value) is not None:
                continue
            accepted += 1
            candidate = _AllTypes()
            object.__setattr__(candidate, name, value)
            back = decode_event(encode_event(candidate))
            assert invalid_field(back) is None, (name, value)
        assert accepted >= 1, name

    @pytest.mark.parametrize("name", CHECKED_FIELDS)
    def test_what_the_reader_refuses_the_rule_refuses(self, name: str) -> None:
        """Unreadable (or unwritable) => refused by the rule: the writer never writes it."""
        rule = field_rule(typing.get_type_hints(_AllTypes)[name])
        assert rule is not None
        for value in self.CANDIDATES:
            candidate = _AllTypes()
            object.__setattr__(candidate, name, value)
            try:
                line = encode_event(candidate)
                decode_event(line)
            except (TypeError, EventDecodeError):
                assert rule.check(value) is not None, (name, value)


class TestPerStepRecords:
    def test_step_records_skip_the_constructor_check(self) -> None:
        """StepCompleted and StepChecked, built on every step, are checked by the writer only."""
        assert StepCompleted._check_fields is False and StepChecked._check_fields is False
        event = StepCompleted(step=1, loss="0.5")  # type: ignore[arg-type]
        assert invalid_field(event) == ("loss", "must be a float or None, got str '0.5'")
        with pytest.raises(TypeError, match=r"cannot encode StepCompleted: field 'loss'"):
            encode_event(event)

    def test_other_classes_check(self) -> None:
        """Every other registered class checks its fields at construction."""
        unchecked = [k for k in LIBRARY_KINDS if not event_types()[k]._check_fields]
        assert unchecked == ["step_checked", "step_completed"]


class TestFallbacks:
    def test_forward_references_are_checked_after_init(self) -> None:
        """An annotation not resolvable when the class is made is checked at construction."""
        assert _Later(value=_DefinedLater(x=1.0)).value == _DefinedLater(x=1.0)
        with pytest.raises(TypeError, match=r"_Later\.value must be a _DefinedLater or None"):
            _Later(value="p")  # type: ignore[arg-type]

    def test_a_post_init_class_is_checked_after_it(self) -> None:
        """A class fast_init cannot speed up (a __post_init__) still checks its fields."""

        @event_type
        class _Post(Event):
            kind: ClassVar[str] = "tests.s6.post"
            count: int = 0

            def __post_init__(self) -> None:
                pass

        assert _Post(count=2).count == 2
        with pytest.raises(TypeError, match=r"_Post\.count must be an int, got str"):
            _Post(count="2")  # type: ignore[arg-type]

    def test_defaults_and_factories_are_trusted(self) -> None:
        """A default factory's value is not checked; a value passed for it is."""
        assert _AllTypes().numbers == {}
        assert ErrorRaised(error_type="E", message="m").context == {}
        assert ErrorRaised(error_type="E", message="m", severity=Severity.INFO).rank >= 0
        with pytest.raises(TypeError, match=r"ErrorRaised\.rank must be an int"):
            ErrorRaised(error_type="E", message="m", rank="0")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"ErrorRaised\.time_ns must be an int"):
            ErrorRaised(error_type="E", message="m", time_ns=1.5)  # type: ignore[arg-type]

    def test_role_enum_passes(self) -> None:
        """Enum members of the declared enum pass."""
        assert NonFiniteDetected(role=TensorRole.LOSS).role is TensorRole.LOSS


class TestFastInitChecks:
    def test_guards_call_reject_only_when_true(self) -> None:
        """fast_init(checks=...): the guard decides; reject sees the value; factories trusted."""
        seen: list[object] = []

        def reject(value: object) -> None:
            seen.append(value)
            if value == "bad":
                msg = "bad value"
                raise TypeError(msg)

        @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
        class Rec:
            a: int = 0
            b: list[int] = field(default_factory=list)

        guard = FieldCheck("{v}.__class__ is not {p}t", {"t": int}, reject)
        fast_init(Rec, checks={"a": guard, "b": FieldCheck("True", {}, reject)})
        assert Rec(a=3).a == 3 and seen == []  # an int: the guard is false
        assert Rec(a="ok").a == "ok"  # type: ignore[arg-type,comparison-overlap]
        assert seen == ["ok"]
        with pytest.raises(TypeError, match="bad value"):
            Rec(a="bad")  # type: ignore[arg-type]
        seen.clear()
        assert Rec().b == [] and seen == []  # the factory's value is not checked
        assert Rec(b=[1]).b == [1] and seen == [[1]]
        with pytest.raises(dataclasses.FrozenInstanceError):
            Rec().a = 1  # type: ignore[misc]
