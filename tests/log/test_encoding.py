"""encode_event / decode_event: exact round trips, NaN and ±Inf included, clear errors."""

from __future__ import annotations

import dataclasses
import math
import random
import threading
from collections.abc import Mapping
from dataclasses import field
from enum import Enum
from typing import Any, ClassVar

import orjson
import pytest

from eventbus_debug import Event, Severity, decode_event, encode_event, event_type
from eventbus_debug.events import SinkFailed, StepCompleted
from eventbus_debug.exceptions import EventDecodeError
from eventbus_debug.log.encoding import encode_events
from eventbus_debug.testing import make_sample_event

SPECIALS = (math.nan, math.inf, -math.inf)


class _Color(Enum):
    RED = "red"


@dataclasses.dataclass(frozen=True, slots=True)
class _Point:
    x: float
    y: float | None = None


@event_type
class _Floats(Event):
    kind: ClassVar[str] = "test.encoding.floats"
    plain: float = 0.0
    optional: float | None = None
    pairs: tuple[tuple[str, float], ...] = ()
    series: tuple[float, ...] = ()
    table: Mapping[str, float] = field(default_factory=dict)
    point: _Point = _Point(x=0.0)
    points: tuple[_Point, ...] = ()
    color: _Color = _Color.RED
    count: int = 0
    either: int | float = 0


def _same(a: Any, b: Any) -> bool:
    """Structural equality in which NaN equals NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _roundtrip(ev: Event) -> Event:
    line = encode_event(ev)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert b"null" not in line or "None" in repr(ev)
    return decode_event(line)


class TestRoundTrip:
    def test_header_and_kind(self) -> None:
        """The kind comes first; the header survives."""
        ev = StepCompleted(step=3, loss=0.25, source="loop", rank=1, seq=9, time_ns=123)
        line = encode_event(ev)
        assert line.startswith(b'{"kind":"step_completed",')
        back = decode_event(line)
        assert back == ev and type(back) is StepCompleted

    @pytest.mark.parametrize("value", SPECIALS, ids=["nan", "inf", "-inf"])
    @pytest.mark.parametrize(
        "shape",
        ["plain", "optional", "pairs", "series", "table", "point", "point_y", "points", "either"],
    )
    def test_non_finite_in_every_shape(self, shape: str, value: float) -> None:
        """NaN, +Inf and -Inf survive in plain, Optional, tuple, Mapping and nested fields."""
        cases: dict[str, dict[str, Any]] = {
            "plain": {"plain": value},
            "optional": {"optional": value},
            "pairs": {"pairs": (("a", 1.0), ("b", value))},
            "series": {"series": (1.0, value, 2.0)},
            "table": {"table": {"w": value, "b": 0.5}},
            "point": {"point": _Point(x=value)},
            "point_y": {"point": _Point(x=1.0, y=value)},
            "points": {"points": (_Point(x=1.0), _Point(x=value, y=value))},
            "either": {"either": value},
        }
        kwargs = cases[shape]
        ev = _Floats(**kwargs)
        line = encode_event(ev)
        token = {"nan": b'"NaN"', "inf": b'"Infinity"', "-inf": b'"-Infinity"'}
        assert token[repr(value)] in line
        back = decode_event(line)
        assert type(back) is _Floats
        assert _same(back, ev), (back, ev)

    def test_finite_values_unchanged(self) -> None:
        """Ordinary values round-trip exactly, including the enum and ints."""
        ev = _Floats(
            plain=1.5,
            optional=None,
            pairs=(("a", 2.0),),
            series=(1.0,),
            table={"x": 3.0},
            point=_Point(x=1.0, y=None),
            count=7,
            either=3,
            severity=Severity.WARNING,
        )
        back = _roundtrip(ev)
        assert _same(back, ev)
        assert isinstance(back, _Floats) and back.either == 3

    def test_every_registered_kind_round_trips(self) -> None:
        """A sample of every registered event class survives the round trip."""
        from eventbus_debug.events import event_types

        for cls in event_types().values():
            ev = make_sample_event(cls)
            assert _same(decode_event(encode_event(ev)), ev), cls

    def test_batch_encoding_matches_per_event(self) -> None:
        """encode_events is the concatenation of encode_event."""
        evs = [StepCompleted(step=i, loss=(math.nan if i == 2 else i * 0.5)) for i in range(5)]
        assert encode_events(evs) == b"".join(encode_event(e) for e in evs)
        assert encode_events([]) == b""

    def test_decode_parsed_mapping(self) -> None:
        """decode_event accepts the parsed JSON object too."""
        ev = SinkFailed(sink="s", error_type="E", message="m")
        assert decode_event(orjson.loads(encode_event(ev))) == ev

    def test_unknown_fields_ignored(self) -> None:
        """A newer writer's extra fields do not break an older reader."""
        obj = orjson.loads(encode_event(StepCompleted(step=1)))
        obj["from_the_future"] = 1
        assert decode_event(obj).step == 1


def _mixed_batch(n: int, seed: int) -> list[Event]:
    """Runs of a few classes, of random lengths, with careful-path events inside the runs."""
    rng = random.Random(seed)
    floats = [0.5, math.nan, math.inf, -math.inf, None, 1e300, -0.0, 3]
    out: list[Event] = []
    while len(out) < n:
        pick = rng.random()
        for _ in range(rng.choice([1, 2, 7, 300])):
            if pick < 0.5:
                out.append(
                    StepCompleted(
                        step=len(out),
                        loss=rng.choice(floats),
                        severity=rng.choice(list(Severity)),
                        source=rng.choice(["", 'a"b\nc', "ü"]),
                    )
                )
            elif pick < 0.8:
                out.append(
                    _Floats(
                        plain=rng.choice([1.5, math.nan]),
                        series=(1.0, rng.choice([2.0, math.inf])),
                        table={"a": rng.choice([1.0, -math.inf])},
                        points=(_Point(x=0.25, y=math.nan),),
                    )
                )
            else:
                out.append(SinkFailed(sink="s", error_type="E", message=f"m{len(out)}"))
    return out[:n]


class TestBatchEncoding:
    """encode_events encodes runs of one class in generated loops: the bytes never change."""

    @pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 1000, 5000])
    def test_mixed_runs_match_per_event(self, n: int) -> None:
        """Runs of every length, across the 256-event joins, are the per-event lines."""
        evs = _mixed_batch(n, seed=n)
        expected = b"".join(encode_event(e) for e in evs)
        assert encode_events(evs) == expected
        assert encode_events(iter(evs)) == expected
        assert encode_events(tuple(evs)) == expected

    def test_every_registered_kind_in_one_batch(self) -> None:
        """Every registered class, alone and repeated, in one batch."""
        from eventbus_debug.events import event_types

        samples = [make_sample_event(cls) for cls in event_types().values()]
        evs = [e for e in samples for _ in range(3)] + samples[::-1] + samples
        assert encode_events(evs) == b"".join(encode_event(e) for e in evs)

    @pytest.mark.parametrize("at", [0, 255, 256, 599])
    def test_first_unencodable_event_is_named(self, at: int) -> None:
        """A wrong-typed event anywhere in a batch: the error names its field, as encode_event."""
        evs: list[Event] = [StepCompleted(step=i, loss=0.5) for i in range(600)]
        evs[at] = StepCompleted(step=at, loss="x")  # type: ignore[arg-type]
        evs.append(StepCompleted(step="late"))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"cannot encode StepCompleted: field 'loss'"):
            encode_events(evs)

    def test_not_an_event_in_a_batch(self) -> None:
        """Something that is not an Event is refused as encode_event refuses it."""
        evs: list[Any] = [StepCompleted(step=0), {"kind": "step_completed"}, StepCompleted(step=1)]
        with pytest.raises(TypeError, match="encode_event needs an Event, got dict"):
            encode_events(evs)

    def test_threads_encode_at_once(self) -> None:
        """Two threads encoding batches of the same classes never mix their lines."""
        batches = [_mixed_batch(700, seed=s) for s in range(2)]
        expected = [b"".join(encode_event(e) for e in b) for b in batches]
        wrong: list[int] = []

        def work(k: int) -> None:
            for _ in range(30):
                if encode_events(batches[k]) != expected[k]:
                    wrong.append(k)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not wrong


class TestErrors:
    def test_encode_non_event(self) -> None:
        """Only events can be encoded."""
        with pytest.raises(TypeError, match="encode_event needs an Event, got dict"):
            encode_event({"a": 1})  # type: ignore[arg-type]

    def test_encode_unserializable_value(self) -> None:
        """A value orjson cannot write (e.g. a tensor) gets an actionable message naming it.

        The constructor refuses it; the encoder refuses an event changed after construction.
        """
        ev = SinkFailed(sink="s", error_type="E", message="m")
        object.__setattr__(ev, "message", object())
        with pytest.raises(
            TypeError, match=r"cannot encode SinkFailed: field 'message' .*plain host values"
        ):
            encode_event(ev)

    def test_unknown_kind(self) -> None:
        """An unknown kind says what to do."""
        with pytest.raises(EventDecodeError, match="unknown event kind 'nope'; import the module"):
            decode_event(b'{"kind":"nope"}')
        with pytest.raises(EventDecodeError, match="unknown event kind None"):
            decode_event(b'{"step":1}')

    def test_missing_field(self) -> None:
        """A missing required field is named."""
        with pytest.raises(
            EventDecodeError, match=r"sink_failed line lacks required field\(s\) \['error_type'"
        ):
            decode_event(b'{"kind":"sink_failed","sink":"s"}')

    def test_bad_json(self) -> None:
        """Invalid JSON and non-object JSON are rejected clearly."""
        with pytest.raises(EventDecodeError, match="not a JSON event line"):
            decode_event(b'{"kind":"step_completed",')
        with pytest.raises(EventDecodeError, match="must hold a JSON object, got list"):
            decode_event(b"[1, 2]")

    def test_bad_field_value(self) -> None:
        """A field of the wrong type is reported with the kind."""
        with pytest.raises(EventDecodeError, match="step_completed line has a bad field"):
            decode_event(b'{"kind":"step_completed","loss":"heavy"}')
        with pytest.raises(EventDecodeError, match="step_completed line has a bad field"):
            decode_event(b'{"kind":"step_completed","severity":"loud"}')

    def test_decode_error_is_value_error(self) -> None:
        """EventDecodeError is a ValueError."""
        with pytest.raises(ValueError):
            decode_event("")


class TestUntrustedInput:
    @pytest.mark.parametrize(
        ("field", "value", "expected"),
        [
            ("step", '"abc"', "integer"),
            ("step", "true", "integer"),
            ("step", "1.5", "integer"),
            ("seq", "99999999999999999999999", "integer"),
            ("source", "[1]", "string"),
            ("loss", '"1.5"', "number"),
            ("loss", "{}", "number"),
            ("rank", "null", "integer"),
        ],
    )
    def test_wrong_field_type_is_named(self, field: str, value: str, expected: str) -> None:
        """Every field is checked against its declared type; the error names the field."""
        obj = orjson.loads(encode_event(StepCompleted(step=1, loss=0.5)))
        line = orjson.dumps(obj).replace(
            f'"{field}":'.encode() + orjson.dumps(obj[field]), f'"{field}":{value}'.encode()
        )
        with pytest.raises(EventDecodeError, match=rf"field '{field}'.*{expected}"):
            decode_event(line)

    def test_nested_types_are_checked(self) -> None:
        """Mappings and sequences are checked item by item (keys and values)."""
        base = {"kind": "events_dropped", "sink": "s", "dropped": 1, "total_dropped": 1}
        with pytest.raises(EventDecodeError, match=r"field 'by_kind'.*integer"):
            decode_event({**base, "by_kind": {"a": "many"}})
        with pytest.raises(EventDecodeError, match=r"field 'by_kind'.*object"):
            decode_event({**base, "by_kind": [1, 2]})

    def test_decoded_events_always_encode_again(self) -> None:
        """Seeded mutations of a valid line: each decodes to an encodable event or is rejected."""
        rng = random.Random(12)
        good = orjson.loads(encode_event(_Floats(plain=1.0, series=(1.0, 2.0), table={"a": 1.0})))
        junk: list[object] = ["x", 1, -1, 2.5, None, True, [], {}, [1, "a"], {"k": [None]}]
        for _ in range(400):
            obj = dict(good)
            name = rng.choice([k for k in obj if k != "kind"])
            obj[name] = rng.choice(junk)
            try:
                event = decode_event(obj)
            except EventDecodeError:
                continue
            assert decode_event(encode_event(event)) == event
