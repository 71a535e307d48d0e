"""Resuming a checkpointed run: ``Session.state_dict()`` / ``load_state_dict()``.

A multi-day run is preempted and resumed from its last checkpoint. The session saved beside
the model and optimizer must let the resumed run be judged exactly as the uninterrupted one:
same incidents at the same steps, same detector state at the end. A malformed or foreign state
is refused with an error naming the field, and leaves the session as it was.
"""

from __future__ import annotations

import copy
import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from torch import nn

from eventbus_debug import (
    DebugLevel,
    Session,
    StepProbe,
    SyncEventBus,
    SyncSession,
    Thresholds,
    read_events,
)
from eventbus_debug.events import RUN_ID_ENV, Anomaly
from eventbus_debug.sinks.report import ReportWriter, build_report, summarize_runs
from eventbus_debug.testing import RecordingSink
from tests._doubles import quiet

STEPS = 900
RESUME = 450
SPIKE = 700
"""A planted loss spike after the resume: the resumed run must report it at the same step."""


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)


_GEN = torch.Generator().manual_seed(3)
_X = torch.randn(STEPS, 16, 8, generator=_GEN)
_W = torch.randn(8, 1, generator=_GEN)
_Y = _X @ _W + 0.3 * torch.randn(STEPS, 16, 1, generator=_GEN)  # noisy minibatches


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(_X[step]), _Y[step])
    return loss + 25.0 if step == SPIKE else loss  # the loss alone: its gradients are the same


def _sync_steps(
    session: SyncSession, model: nn.Module, opt: torch.optim.Optimizer, steps: range
) -> None:
    """Train *steps* through a ``SyncSession``, stepping when its verdict says so."""
    for step in steps:
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, step)
        torch.autograd.backward(loss)
        if session.check_step(step, loss=loss).should_step:
            opt.step()
        session.step_completed(step)


async def _steps(
    session: Session, model: nn.Module, opt: torch.optim.Optimizer, lo: int, hi: int
) -> None:
    for step in range(lo, hi):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, step)
        torch.autograd.backward(loss)
        verdict = await session.check_step(step, loss=loss)
        if verdict.should_step:
            opt.step()
        await session.step_completed(step, loss=verdict.loss)


def _incidents(recorder: RecordingSink) -> list[tuple[int | None, str]]:
    return [(e.step, e.kind) for e in recorder.events if isinstance(e, Anomaly)]


async def _uninterrupted() -> tuple[list[tuple[int | None, str]], dict[str, Any]]:
    model, opt = _model()
    recorder = RecordingSink()
    async with Session(model, opt, sinks=[recorder], **quiet()) as session:
        await _steps(session, model, opt, 0, STEPS)
        return _incidents(recorder), session.state_dict()


async def _checkpoint() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The first half: the model's, the optimizer's and the session's state at RESUME."""
    model, opt = _model()
    async with Session(model, opt, **quiet()) as session:
        await _steps(session, model, opt, 0, RESUME)
        state = session.state_dict()
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), state


def _judged(state: dict[str, Any]) -> dict[str, Any]:
    """*state* without its run id (another run's, when compared with the uninterrupted one)."""
    return {k: v for k, v in state.items() if k != "run_id"}


def _through_disk(state: dict[str, Any], how: str) -> Any:
    if how == "json":  # strict JSON: no Infinity, no NaN
        return json.loads(json.dumps(state, allow_nan=False))
    if how == "orjson":
        return orjson.loads(orjson.dumps(state))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("how", ["json", "orjson", "torch"])
async def test_resumed_run_is_judged_as_the_uninterrupted_one(how: str) -> None:
    """Same incidents at the same steps (the planted spike included) and the same detector
    state at the end, after a round trip through json or torch.save(weights_only=True)."""
    expected, final = await _uninterrupted()
    assert (SPIKE, "loss_spiked") in expected
    weights, optim, state = await _checkpoint()
    assert '"inf"' in json.dumps(state)  # an infinity, written so that strict JSON carries it
    model, opt = _model()
    model.load_state_dict(weights)
    opt.load_state_dict(optim)
    recorder = RecordingSink()
    session = Session(model, opt, sinks=[recorder], **quiet())
    session.load_state_dict(_through_disk(state, how))  # before the start: applied at it
    async with session:
        assert session.step == RESUME - 1
        assert session.next_step() == RESUME
        await _steps(session, model, opt, RESUME, STEPS)
        resumed = session.state_dict()
    assert _incidents(recorder) == [i for i in expected if i[0] is not None and i[0] >= RESUME]
    assert _judged(resumed) == _judged(final)
    assert resumed["run_id"] == state["run_id"]  # the first half's run, continued


async def test_a_cold_session_knows_nothing_of_the_run() -> None:
    """Without the state, the resumed session's detectors start from nothing (what makes it
    report a converged noisy run's ordinary batches): its state differs from the run's."""
    _, final = await _uninterrupted()
    weights, optim, _ = await _checkpoint()
    model, opt = _model()
    model.load_state_dict(weights)
    opt.load_state_dict(optim)
    async with Session(model, opt, **quiet()) as session:
        await _steps(session, model, opt, RESUME, STEPS)
        cold = session.state_dict()
    judged = final["probe"]["judge"]["spikes"]["judged"]
    assert cold["probe"]["judge"]["spikes"]["judged"] == judged - RESUME
    assert cold != final


async def test_load_between_steps_of_a_running_session() -> None:
    weights, optim, state = await _checkpoint()
    model, opt = _model()
    model.load_state_dict(weights)
    opt.load_state_dict(optim)
    async with Session(model, opt, **quiet()) as session:
        session.load_state_dict(state)
        assert session.step == RESUME - 1
        assert _judged(session.state_dict()) == _judged(state)
        assert session.state_dict()["run_id"] == session.run_id  # announced before the load


def test_sync_session_saves_and_loads_the_same_state() -> None:
    model, opt = _model()
    with SyncSession(model, opt, **quiet()) as session:
        _sync_steps(session, model, opt, range(50))
        state = session.state_dict()
    assert state["step"] == 49
    again = SyncSession(model, opt, **quiet())
    again.load_state_dict(state)
    assert again.state_dict() == state  # before the start: the state it will start from
    with again:
        assert again.state_dict() == state


async def test_state_before_the_start_is_empty_and_loads() -> None:
    model, opt = _model()
    fresh = Session(model, opt, **quiet()).state_dict()
    assert fresh["step"] is None and fresh["probe"] is None
    session = Session(model, opt, **quiet())
    session.load_state_dict(fresh)
    async with session:
        assert session.step is None


async def test_an_ended_session_refuses_a_state() -> None:
    _, _, state = await _checkpoint()
    model, opt = _model()
    async with Session(model, opt, **quiet()) as session:
        pass
    with pytest.raises(RuntimeError, match="has ended"):
        session.load_state_dict(state)
    assert session.state_dict()["probe"] is not None  # still readable after the end


async def test_parameters_are_matched_by_name() -> None:
    """A model that gained a layer loads the state: known parameters keep their history, the
    new one starts afresh; one that lost a parameter drops its history."""
    _, _, state = await _checkpoint()
    torch.manual_seed(0)
    bigger = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), nn.Linear(1, 1))
    opt = torch.optim.SGD(bigger.parameters(), lr=0.01)
    async with Session(bigger, opt, **quiet()) as session:
        session.load_state_dict(state)
        layers = session.state_dict()["probe"]["judge"]["layers"]
        saved = state["probe"]["judge"]["layers"]
        assert layers["references"] == saved["references"]
        assert not any(name.startswith("3.") for name in layers["references"])
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(bigger(_X[step]), _Y[step])
            torch.autograd.backward(loss)
            verdict = await session.check_step(RESUME + step, loss=loss)
            assert verdict.should_step
            opt.step()
            await session.step_completed(RESUME + step)


async def test_changed_thresholds_keep_their_own_sizes() -> None:
    """A state saved with a 50-loss window, loaded with a 10-loss one: the last 10 are kept."""
    _, _, state = await _checkpoint()
    model, opt = _model()
    async with Session(model, opt, thresholds=Thresholds(spike_window=10), **quiet()) as s:
        s.load_state_dict(state)
        window = s.state_dict()["probe"]["judge"]["spikes"]["window"]
    assert window == state["probe"]["judge"]["spikes"]["window"][-10:]


def _edit(state: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    edited = copy.deepcopy(state)
    change(edited)
    return edited


def _set(path: tuple[str | int, ...], value: object) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        node: Any = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


def _drop(path: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        node: Any = state
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return change


BAD_STATES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("format", _set(("format",), "something.else"), "is not a Session.state_dict()"),
    ("later version", _set(("version",), 99), "upgrade eventbus-debug"),
    ("step", _set(("step",), -1), r"state\['step'\] must be an int >= 0"),
    ("missing judge", _drop(("probe", "judge")), r"state\['probe'\]\['judge'\] is missing"),
    (
        "not a number",
        _set(("probe", "judge", "spikes", "window", 3), "x"),
        r"state\['probe'\]\['judge'\]\['spikes'\]\['window'\]\[3\] must be a number",
    ),
    (
        "nan",
        _set(("probe", "judge", "explosions", "largest"), math.nan),
        r"\['explosions'\]\['largest'\] must be a number",
    ),
    (
        "bool for a count",
        _set(("probe", "judge", "vanish_streak"), True),
        r"\['vanish_streak'\] must be an int >= 0",
    ),
    (
        "not a dict",
        _set(("probe", "judge", "layers"), [1, 2]),
        r"\['layers'\] must be a dict",
    ),
    (
        "probe format",
        _set(("probe", "format"), "nope"),
        r"state\['probe'\] is not a StepProbe.state_dict\(\)",
    ),
]


@pytest.mark.parametrize(("what", "change", "message"), BAD_STATES, ids=[b[0] for b in BAD_STATES])
async def test_a_bad_state_is_refused_and_changes_nothing(
    what: str, change: Callable[[dict[str, Any]], None], message: str
) -> None:
    _, _, state = await _checkpoint()
    bad = _edit(state, change)
    model, opt = _model()
    before_start = Session(model, opt, **quiet())
    with pytest.raises(ValueError, match=message):
        before_start.load_state_dict(bad)  # checked whole when given, not at the start
    async with Session(model, opt, **quiet()) as session:
        await _steps(session, model, opt, 0, 20)
        kept = session.state_dict()
        with pytest.raises(ValueError, match=message):
            session.load_state_dict(bad)
        assert session.state_dict() == kept


@pytest.mark.parametrize("state", [None, [], "state", 3])
def test_not_a_dict_is_refused(state: object) -> None:
    model, opt = _model()
    with pytest.raises(ValueError, match="state must be a dict"):
        Session(model, opt, **quiet()).load_state_dict(state)  # type: ignore[arg-type]


def test_a_probe_state_is_not_a_session_state() -> None:
    model, _ = _model()
    probe_state = StepProbe(model, None).state_dict()
    with pytest.raises(ValueError, match=r"its format is 'eventbus_debug\.StepProbe'"):
        Session(model, None, **quiet()).load_state_dict(probe_state)


def test_deferred_probe_reads_its_steps_in_flight_first() -> None:
    """The state of a deferred probe includes the steps still on their way to the host."""
    model, opt = _model()
    recorder = RecordingSink()
    with SyncEventBus() as bus:
        bus.subscribe(recorder)
        probe = StepProbe(model, bus, deferred=True, level=DebugLevel.BASIC)
        for step in range(30):
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, step)
            torch.autograd.backward(loss)
            probe.check_step_sync(step, loss=loss)
            opt.step()
        state = probe.state_dict()
    assert state["judge"]["spikes"]["judged"] == 30  # every step judged, the last included
    again = StepProbe(model, None)
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_probe_state_spike_memories_round_trip() -> None:
    """A probe that saw spikes (outliers, streaks) carries them: loading into a fresh probe
    gives back the same state, field for field."""
    model, _ = _model()
    probe = StepProbe(model, None)
    for step in range(200):
        model.zero_grad()
        loss = _loss(model, step) * (30.0 if step % 37 == 5 else 1.0)
        torch.autograd.backward(loss)
        probe.check_step_sync(step, loss=loss)
    state = probe.state_dict()
    assert state["judge"]["spikes"]["outliers"]  # something was remembered
    fresh = StepProbe(model, None)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.state_dict() == state


# -- recovery's temporary LR changes ---------------------------------------------------------------

AGGRESSIVE_SPIKE = 150
AGGRESSIVE_SAVE = 200
AGGRESSIVE_END = 450


async def _aggressive(
    lo: int, hi: int, model: nn.Module, opt: torch.optim.Optimizer, state: Any = None
) -> tuple[dict[str, Any], list[float]]:
    """Steps *lo* .. *hi* under the aggressive policy (a spike at AGGRESSIVE_SPIKE rolls back
    and halves the LR for 200 healthy steps); the session's state and the LR per step."""
    lrs: list[float] = []
    session = Session(model, opt, policy="aggressive", **quiet())
    if state is not None:
        session.load_state_dict(state)
    async with session:
        for step in range(lo, hi):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(_X[step]), _Y[step])
            if step == AGGRESSIVE_SPIKE:
                loss = loss + 25.0
            torch.autograd.backward(loss)
            verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                opt.step()
            await session.step_completed(step, loss=verdict.loss)
            lrs.append(opt.param_groups[0]["lr"])
        return session.state_dict(), lrs


async def test_a_temporary_lr_change_is_undone_after_a_resume() -> None:
    """A rollback's temporary LR halving in force at the checkpoint: the optimizer's state
    dict holds the halved LR, the session's state says when to undo it. Resumed with it, the
    LR comes back on the same step as in the uninterrupted run; resumed cold, it never would."""
    model, opt = _model()
    _, full = await _aggressive(0, AGGRESSIVE_END, model, opt)
    base = full[0]
    assert min(full) == pytest.approx(base / 2)  # the rollback halved it ...
    assert full[-1] == pytest.approx(base)  # ... for 200 healthy steps
    model, opt = _model()
    state, first = await _aggressive(0, AGGRESSIVE_SAVE, model, opt)
    assert first[-1] == pytest.approx(base / 2)  # in force at the checkpoint
    assert state["recovery"]["temporary_lr_changes"][0]["groups"] == [0]
    weights, optim = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    saved = json.loads(json.dumps(state))
    for carried in (True, False):
        model, opt = _model()
        model.load_state_dict(weights)
        opt.load_state_dict(optim)
        _, rest = await _aggressive(
            AGGRESSIVE_SAVE, AGGRESSIVE_END, model, opt, saved if carried else None
        )
        if carried:
            assert first + rest == pytest.approx(full)
        else:
            assert rest[-1] == pytest.approx(base / 2)  # what the state prevents


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"left": 3, "factor": 0.0, "groups": [0]}, r"\['factor'\] must be a finite number > 0"),
        ({"left": -1, "factor": 0.5, "groups": [0]}, r"\['left'\] must be an int >= 0"),
        ({"left": 3, "factor": 0.5, "groups": ["a"]}, r"\['groups'\]\[0\] must be an int >= 0"),
        ({"left": 3, "factor": 0.5}, r"\['groups'\] is missing"),
    ],
)
def test_a_bad_temporary_lr_change_is_refused(change: dict[str, Any], message: str) -> None:
    model, opt = _model()
    state = Session(model, opt, **quiet()).state_dict()
    state["recovery"] = {"temporary_lr_changes": [change]}
    with pytest.raises(ValueError, match=message):
        Session(model, opt, **quiet()).load_state_dict(state)


# -- the run in the log ----------------------------------------------------------------------------


@pytest.fixture
def fresh_run_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """No run id from the environment: each session draws its own, unless a state gives one."""
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


@pytest.mark.usefixtures("fresh_run_ids")
async def test_the_resumed_session_continues_the_run_in_the_log(tmp_path: Path) -> None:
    """One run id for the job: the log's summary covers both halves as one run."""
    model, opt = _model()
    async with Session(model, opt, log_dir=tmp_path, report=False, alerts=False) as first:
        await _steps(first, model, opt, 0, 40)
        state = first.state_dict()
    assert state["run_id"] == first.run_id
    second = Session(model, opt, log_dir=tmp_path, report=False, alerts=False)
    second.load_state_dict(json.loads(json.dumps(state)))
    assert second.state_dict()["run_id"] == first.run_id
    async with second:
        await _steps(second, model, opt, 40, 80)
    assert second.run_id == first.run_id
    summary = summarize_runs(read_events(tmp_path, run="all"))
    assert [r.run_id for r in summary.runs] == [first.run_id]
    assert summary.steps == 80


async def test_an_explicit_run_id_wins_over_the_saved_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, state = await _checkpoint()
    assert state["run_id"]
    monkeypatch.setenv(RUN_ID_ENV, "my-run-2")
    model, opt = _model()
    session = Session(model, opt, **quiet())
    session.load_state_dict(state)
    async with session:
        assert session.run_id == "my-run-2"


@pytest.mark.parametrize("run_id", ["", "  ", 3])
async def test_a_bad_run_id_is_refused(run_id: object) -> None:
    _, _, state = await _checkpoint()
    state["run_id"] = run_id
    model, opt = _model()
    with pytest.raises(ValueError, match=r"state\['run_id'\] must be a non-empty str or None"):
        Session(model, opt, **quiet()).load_state_dict(state)


@pytest.mark.usefixtures("fresh_run_ids")
async def test_the_live_report_covers_the_whole_resumed_run(tmp_path: Path) -> None:
    """The resumed session's report.json covers both halves, as ``eventbus-debug report``."""
    model, opt = _model()
    async with Session(model, opt, log_dir=tmp_path, alerts=False) as first:
        await _steps(first, model, opt, 0, 40)
        state = first.state_dict()
    second = Session(model, opt, log_dir=tmp_path, alerts=False)
    second.load_state_dict(state)
    async with second:
        await _steps(second, model, opt, 40, 80)
    live = json.loads((tmp_path / "report.json").read_text())
    assert live["run_id"] == first.run_id
    rebuilt, _ = build_report(tmp_path, tmp_path / "rebuilt")
    assert live["summary"]["steps"] == rebuilt.steps == 80
    assert live["summary"]["first_step"] == 0


def test_a_restart_with_the_same_run_id_continues_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a state, a run id named by the environment (a job restarted as itself)
    continues the report as well."""
    monkeypatch.setenv(RUN_ID_ENV, "job-7")
    model, opt = _model()
    for lo, hi in ((0, 30), (30, 50)):
        with SyncSession(model, opt, log_dir=tmp_path, alerts=False) as session:
            _sync_steps(session, model, opt, range(lo, hi))
        assert session.run_id == "job-7"
    live = json.loads((tmp_path / "report.json").read_text())
    assert live["summary"]["steps"] == 50


def test_continue_run_folds_only_that_run(tmp_path: Path) -> None:
    model, opt = _model()
    with SyncSession(model, opt, log_dir=tmp_path / "log", report=False, alerts=False) as s:
        for step in range(10):
            opt.zero_grad(set_to_none=True)
            torch.autograd.backward(_loss(model, step))
            s.check_step(step)
            s.step_completed(step)
    assert s.run_id is not None
    writer = ReportWriter(tmp_path / "out")
    assert writer.continue_run(tmp_path / "log", "another-run") == 0
    assert writer.continue_run(tmp_path / "missing", s.run_id) == 0
    assert writer.summary().events == 0
    assert writer.continue_run(tmp_path / "log", s.run_id) > 0
    assert writer.summary().steps == 10
    empty = tmp_path / "no-log-files"
    empty.mkdir()
    assert writer.continue_run(empty, s.run_id) == 0  # a warning, never an error
    assert writer.summary().steps == 10


async def test_a_cold_resume_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """An optimizer that has already stepped and no state loaded: one warning that says how
    to carry the state; none for a fresh run, none with the state."""
    weights, optim, state = await _checkpoint()

    async def start(load: bool, restored: bool) -> list[str]:
        model, opt = _model()
        if restored:
            model.load_state_dict(weights)
            opt.load_state_dict(optim)
        session = Session(model, opt, **quiet())
        if load:
            session.load_state_dict(state)
        caplog.clear()
        with caplog.at_level("WARNING", logger="eventbus_debug"):
            async with session:
                await _steps(session, model, opt, RESUME, RESUME + 3)
        return [r.getMessage() for r in caplog.records if "resumed_without" in r.getMessage()]

    cold = await start(load=False, restored=True)
    assert len(cold) == 1 and "load_state_dict" in cold[0]
    assert await start(load=True, restored=True) == []
    assert await start(load=False, restored=False) == []
