"""Where the last good state is kept: beside the model while small, else in host memory, else
nowhere (said once), so that the default session never doubles a device's memory."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from eventbus_debug import Session, TrainingStopped
from eventbus_debug.events import RecoveryAction, RecoveryApplied, Severity, SnapshotPlaced
from eventbus_debug.recovery import NoGoodStateError, StateSnapshots
from eventbus_debug.recovery.safepoint import _placement
from eventbus_debug.recovery.safepoint._placement import (
    DEVICE_SHARE,
    HOST_SHARE,
    choose,
    local_processes,
    location_of,
    sizes,
)
from eventbus_debug.recovery.safepoint._plan import copied_tensors
from eventbus_debug.sinks import build_report
from eventbus_debug.testing import RecordingSink

from .test_policies import classifier, session_for, train

GIB = 1 << 30
CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)  # a device object only: no accelerator is needed to name one


def _memory(host: int, device: int | None = 80 * GIB, processes: int = 1) -> dict[str, object]:
    return {
        "host": lambda: host,
        "total": lambda _d: device,
        "processes": lambda: processes,
    }


class TestChoose:
    def test_a_small_copy_stays_beside_the_model_on_an_accelerator(self) -> None:
        placed = choose("auto", {GPU: GIB}, **_memory(host=100 * GIB))  # type: ignore[arg-type]
        assert placed.where == "device" and placed.nbytes == GIB

    def test_a_large_copy_goes_to_host_memory(self) -> None:
        """A 1.3 B-parameter AdamW model (21 GB of state) on an 80 GB device: host memory."""
        n = int(80 * GIB * DEVICE_SHARE) + 1
        placed = choose("auto", {GPU: n}, **_memory(host=100 * GIB))  # type: ignore[arg-type]
        assert placed.where == "host"
        assert "over 5% of device memory" in placed.reason and "in host memory" in placed.reason

    def test_no_room_anywhere_keeps_none_and_says_why(self) -> None:
        placed = choose("auto", {GPU: 40 * GIB}, **_memory(host=60 * GIB))  # type: ignore[arg-type]
        assert placed.where == "none"
        assert "40.0 GiB > 30.0 GiB" in placed.reason and "host cannot hold it" in placed.reason

    def test_an_unknown_device_size_is_not_trusted(self) -> None:
        placed = choose("auto", {GPU: 1024}, **_memory(host=GIB, device=None))  # type: ignore[arg-type]
        assert placed.where == "host" and "unknown" in placed.reason

    def test_cpu_training_keeps_its_copy_in_host_memory_within_the_share(self) -> None:
        fits = choose("auto", {CPU: GIB}, **_memory(host=4 * GIB))  # type: ignore[arg-type]
        assert fits.where == "host" and fits.reason.startswith("CPU tensors")
        over = choose("auto", {CPU: 3 * GIB}, **_memory(host=4 * GIB))  # type: ignore[arg-type]
        assert over.where == "none"

    def test_the_host_share_is_split_among_the_local_processes(self) -> None:
        """Eight ranks on one machine each take an eighth of the host share, not all of it."""
        one = choose("auto", {GPU: 20 * GIB}, **_memory(host=100 * GIB, processes=1))  # type: ignore[arg-type]
        eight = choose("auto", {GPU: 20 * GIB}, **_memory(host=100 * GIB, processes=8))  # type: ignore[arg-type]
        assert one.where == "host" and eight.where == "none"
        assert "over 8 local process(es)" in eight.reason
        assert HOST_SHARE * 100 * GIB / 8 < 20 * GIB <= HOST_SHARE * 100 * GIB

    def test_explicit_locations(self) -> None:
        memory = _memory(host=1024)
        assert choose("device", {GPU: 50 * GIB}, **memory).where == "device"  # type: ignore[arg-type]
        assert choose("device", {CPU: 50 * GIB}, **memory).where == "host"  # type: ignore[arg-type]
        assert choose("host", {GPU: 512}, **memory).where == "host"  # type: ignore[arg-type]
        assert choose("host", {GPU: 4096}, **memory).where == "none"  # type: ignore[arg-type]

    def test_tensor_subclasses_stay_on_their_device_and_do_not_count_against_the_host(
        self,
    ) -> None:
        memory = _memory(host=2 * GIB)
        placed = choose("auto", {GPU: 10 * GIB}, stuck=9 * GIB, **memory)  # type: ignore[arg-type]
        assert placed.where == "host" and "1.0 GiB in host memory" in placed.reason

    def test_the_default_memory_figures_are_read(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_placement, "host_available", lambda: 100)
        assert choose("auto", {CPU: 80}).where == "none"
        monkeypatch.setattr(_placement, "host_available", lambda: 1000)
        assert choose("auto", {CPU: 80}).where == "host"

    def test_the_real_memory_figures(self) -> None:
        assert _placement.host_available() > 0  # psutil's available memory
        assert _placement.device_total(CPU) is None  # the host is no accelerator


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 1), ("4", 4), ("0", 1), ("-2", 1), ("many", 1)]
)
def test_local_processes_reads_torchrun(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: int
) -> None:
    if value is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert local_processes() == expected


def test_sizes_count_each_device_and_the_subclasses() -> None:
    class Shard(torch.Tensor):
        pass

    model = nn.Linear(4, 3)  # 12 + 3 float32
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    by_device, stuck = sizes(copied_tensors(model, opt))
    # parameters, exp_avg, exp_avg_sq (15 floats each) and two float32 step counters
    assert by_device == {CPU: 3 * 15 * 4 + 2 * 4} and stuck == 0
    by_device, stuck = sizes(
        [torch.zeros(8).as_subclass(Shard), torch.zeros(2, dtype=torch.float64)]
    )
    assert by_device == {CPU: 32 + 16} and stuck == 32
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 999_999]]), torch.ones(2), (1_000_000,), check_invariants=True
    )
    assert sizes([sparse]) == ({CPU: 2 * 4 + 2 * 8}, 0)  # the stored values, not a million


@pytest.mark.parametrize("bad", ["gpu", "", "AUTO"])
def test_an_unknown_location_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="location must be one of 'auto', 'device', 'host'"):
        StateSnapshots(location=bad)  # type: ignore[arg-type]


def test_a_location_of_another_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="location must be one of"):
        location_of(0)
    assert location_of("host") == "host"


def _saved(model: nn.Module, opt: torch.optim.Optimizer, step: int, path: str) -> str:
    """A snapshot of *model* taken at *step*, saved to *path* (returned), to load as a
    checkpoint."""
    saved = StateSnapshots()
    assert saved.capture(step, model, opt)
    saved.save(path)
    return path


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()
    return model, opt


class TestNotKept:
    def test_no_room_keeps_nothing_says_it_once_and_retries_every_n_good_steps(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        model, opt = _model()
        monkeypatch.setattr(_placement, "host_available", lambda: 16)
        placed: list[int] = []
        real = _placement.choose

        def counting(*args: object, **kwargs: object) -> _placement.Placement:
            placed.append(1)
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr("eventbus_debug.recovery.safepoint.snapshot.choose", counting)
        snaps = StateSnapshots(every=10)
        with caplog.at_level(logging.INFO, logger="eventbus_debug"):
            results = [snaps.maybe_capture(step, model, opt) for step in range(25)]
        assert not any(results) and not snaps.available and snaps.captures == 0
        assert snaps.placement is not None and snaps.placement.where == "none"
        assert len(placed) == 3  # steps 0, 10 and 20, not every step
        said = [r for r in caplog.records if "snapshot_not_kept" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING
        assert "no restore is possible" in said[0].getMessage()
        with pytest.raises(NoGoodStateError, match="the snapshot was not kept, it would not fit"):
            snaps.restore(model, opt)

    async def test_the_bus_hears_when_none_is_kept_and_when_one_is_again(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        model, opt, x, y = classifier()
        recorder = RecordingSink()
        monkeypatch.setattr(_placement, "host_available", lambda: 16)
        async with session_for(model, opt, recorder, snapshots=StateSnapshots(every=10)) as session:
            await train(session, model, opt, x, y, 15)
            monkeypatch.setattr(_placement, "host_available", lambda: 1 << 30)
            await train(session, model, opt, x, y, 15)  # steps 0-14 again: the loop's count
        said = [(e.step, e.where, e.severity) for e in recorder.of_type(SnapshotPlaced)]
        assert said == [(0, "none", Severity.WARNING), (5, "host", Severity.INFO)]

    def test_memory_freed_later_is_used(self, monkeypatch: pytest.MonkeyPatch) -> None:
        model, opt = _model()
        monkeypatch.setattr(_placement, "host_available", lambda: 16)
        snaps = StateSnapshots(every=5)
        assert not snaps.maybe_capture(0, model, opt)
        monkeypatch.setattr(_placement, "host_available", lambda: 1 << 30)
        assert [snaps.maybe_capture(step, model, opt) for step in range(1, 6)] == [
            False,
            False,
            False,
            False,
            True,
        ]
        assert snaps.available and snaps.placement is not None
        assert snaps.placement.where == "host"

    def test_a_held_snapshot_of_a_gone_structure_is_dropped_when_the_new_one_has_no_room(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        model, opt = _model()
        snaps = StateSnapshots(every=1)
        assert snaps.capture(0, model, opt)
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1000))]})  # the plan is stale
        monkeypatch.setattr(_placement, "host_available", lambda: 16)
        assert not snaps.capture(1, model, opt)
        assert not snaps.available and snaps.step is None

    def test_a_loaded_checkpoint_is_kept_when_the_live_copy_has_no_room(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: object
    ) -> None:
        model, opt = _model()
        path = _saved(model, opt, 3, f"{tmp_path}/good.pt")
        snaps = StateSnapshots(checkpoint=path)
        monkeypatch.setattr(_placement, "host_available", lambda: 16)
        assert not snaps.capture(4, model, opt)
        assert snaps.available and snaps.step == 3
        with torch.no_grad():
            model[0].weight.fill_(math.nan)  # type: ignore[index]
        assert snaps.restore(model, opt) == 3
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_host_copy_restores_the_values_it_took() -> None:
    """location='host' on CPU tensors is the same copy; values come back exactly."""
    model, opt = _model()
    snaps = StateSnapshots(location="host")
    assert snaps.capture(0, model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert snaps.restore(model, opt) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class TestSession:
    async def test_the_session_uses_the_snapshots_given(self) -> None:
        model, opt, x, y = classifier()
        snaps = StateSnapshots(every=7, location="host")
        recorder = RecordingSink()
        async with session_for(model, opt, recorder, snapshots=snaps) as session:
            await train(session, model, opt, x, y, 30)
        # the first good step, then every 7 good steps (the plan is rebuilt at step 7, once
        # AdamW created its state)
        assert snaps.captures == 5 and snaps.step == 28
        assert recorder.of_type(SnapshotPlaced) == []  # kept: logged, not published

    async def test_a_nan_parameter_with_no_snapshot_kept_stops_with_the_reason(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(_placement, "host_available", lambda: 16)
        model, opt, x, y = classifier()
        recorder = RecordingSink()
        with pytest.raises(TrainingStopped, match="would not fit in memory"):
            async with session_for(model, opt, recorder) as session:
                await train(session, model, opt, x, y, 40, nan_param_at=(20,))
        failed = [
            e
            for e in recorder.of_type(RecoveryApplied)
            if e.action is RecoveryAction.RESTORE_STATE and e.outcome == "failed"
        ]
        assert len(failed) == 1
        said = recorder.of_type(SnapshotPlaced)  # on the bus (the log, the report) once
        assert [(e.step, e.where, e.severity) for e in said] == [(0, "none", Severity.WARNING)]
        assert "host cannot hold it" in said[0].reason

    async def test_a_healthy_run_without_room_trains_as_usual(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """No room for a snapshot changes nothing on a healthy run: same weights at the end."""
        model, opt, x, y = classifier()
        async with session_for(model, opt, RecordingSink()) as session:
            await train(session, model, opt, x, y, 60)
        kept = [p.detach().clone() for p in model.parameters()]
        monkeypatch.setattr(_placement, "host_available", lambda: 16)
        model, opt, x, y = classifier()
        async with session_for(model, opt, RecordingSink()) as session:
            await train(session, model, opt, x, y, 60)
        assert all(torch.equal(a, b) for a, b in zip(kept, model.parameters(), strict=True))

    def test_bad_snapshots_are_refused_when_the_session_is_made(self) -> None:
        model, opt, _, _ = classifier()
        with pytest.raises(TypeError, match="snapshots must be a StateSnapshots or None"):
            Session(model, opt, log_dir=None, snapshots=50)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="snapshots= needs recovery"):
            Session(model, opt, log_dir=None, recovery=False, snapshots=StateSnapshots())


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    _cuda_step(model, opt)
    return model, opt


def _cuda_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(32, 64, device="cuda")).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@CUDA
def test_cuda_host_copies_are_pinned_and_restore_what_they_took() -> None:
    model, opt = _cuda_model()
    snaps = StateSnapshots(every=1, location="host")
    assert snaps.capture(0, model, opt)
    plan = snaps._plan
    assert plan is not None and plan.host
    assert all(t.device.type == "cpu" and t.is_pinned() for t in plan.model_dst + plan.opt_dst)
    _cuda_step(model, opt)
    expected = [p.detach().clone() for p in model.parameters()]
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    assert snaps.capture(1, model, opt)  # a refresh: copies queued, the host not blocked
    assert plan.pending  # ... and waited for before the host reads them
    with torch.no_grad():  # queued after the copies on the same stream: not in the snapshot
        for p in model.parameters():
            p.add_(1.0)
    assert snaps.restore(model, opt) == 1
    assert not plan.pending
    assert all(torch.equal(a, b) for a, b in zip(expected, model.parameters(), strict=True))
    after = [s["exp_avg"] for s in opt.state.values()]
    assert all(a.device.type == "cuda" for a in after)
    assert all(torch.equal(a, b) for a, b in zip(moments, after, strict=True))
    _cuda_step(model, opt)  # the optimizer steps on its restored state


@CUDA
def test_cuda_auto_keeps_a_small_model_beside_it() -> None:
    model, opt = _cuda_model()
    snaps = StateSnapshots()
    assert snaps.capture(0, model, opt)
    assert snaps.placement is not None and snaps.placement.where == "device"
    plan = snaps._plan
    assert plan is not None and all(t.is_cuda for t in plan.model_dst)


def _trained(hook: bool) -> tuple[nn.Module, torch.optim.Optimizer, StateSnapshots]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    if hook:  # a load hook: only load_state_dict runs it, so the restore goes through it
        opt.register_load_state_dict_post_hook(lambda optimizer: None)
    snaps = StateSnapshots(every=1)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        opt.zero_grad()
        model(torch.randn(16, 4, generator=gen)).pow(2).mean().backward()
        opt.step()
        if step == 3:
            assert snaps.capture(step, model, opt)
    opt.param_groups[0]["lr"] = 0.005  # an LR decided since: kept
    opt.param_groups[0]["weight_decay"] = 0.5  # another setting: restored
    return model, opt, snaps


def test_an_optimizer_is_restored_in_place_exactly_as_load_state_dict_restores_it() -> None:
    """The in-place restore allocates no second optimizer state (a model that fills its GPU
    could not be restored otherwise) and ends exactly where ``load_state_dict`` does."""
    model, opt, snaps = _trained(hook=False)
    moments = {id(p): s["exp_avg"] for p, s in opt.state.items()}
    assert snaps.restore(model, opt) == 3
    assert all(s["exp_avg"] is moments[id(p)] for p, s in opt.state.items())  # the same tensors
    ref_model, ref_opt, ref_snaps = _trained(hook=True)
    ref_moments = {id(p): s["exp_avg"] for p, s in ref_opt.state.items()}
    assert ref_snaps.restore(ref_model, ref_opt) == 3
    assert all(s["exp_avg"] is not ref_moments[id(p)] for p, s in ref_opt.state.items())
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)
    mine, ref = opt.state_dict(), ref_opt.state_dict()
    assert mine["param_groups"] == ref["param_groups"]
    assert mine["param_groups"][0]["lr"] == 0.005 and mine["param_groups"][0]["weight_decay"] == 0.1
    for i, entries in ref["state"].items():
        for k, v in entries.items():
            assert torch.equal(mine["state"][i][k], v), (i, k)
    x = torch.randn(16, 4)  # both train on alike
    for net, optimizer in ((model, opt), (ref_model, ref_opt)):
        optimizer.zero_grad()
        net(x).pow(2).mean().backward()
        optimizer.step()
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_restore_without_memory_for_its_undo_copy_still_restores(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The copy that would undo a load failing part-way is taken where the snapshot is (host
    memory here); when it cannot be had the restore goes on without it, and says so."""
    model, opt = _model()
    snaps = StateSnapshots()
    assert snaps.capture(0, model, opt)
    expected = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan)

    def no_memory(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch.Tensor, "to", no_memory)
    with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
        assert snaps.restore(model, opt) == 0
    monkeypatch.undo()
    assert any("restore_without_undo" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(a, b) for a, b in zip(expected, model.parameters(), strict=True))


class _WithExtraState(nn.Module):
    """A module whose state dict carries ``get_extra_state()``: a dict here, a tensor made anew
    at each call in its sub-module (as quantization and FP8 modules keep their scales)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = _TensorExtra()
        self.meta = {"calls": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.meta["calls"] += 1
        out: torch.Tensor = self.head(self.body(x))
        return out

    def get_extra_state(self) -> dict[str, int]:
        return dict(self.meta)

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.meta = dict(state)


class _TensorExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 1)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale *= 1.5
        y: torch.Tensor = self.out(x)
        return y

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([self.scale])

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.scale = float(state[0])


def test_modules_extra_states_are_kept_refreshed_and_restored() -> None:
    """A model whose state dict holds extra states crashed the first capture (a dict has no
    ``detach``): now they are copied at each capture and loaded back by a restore."""
    torch.manual_seed(0)
    model = _WithExtraState()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snaps = StateSnapshots(every=1)
    for step in range(3):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        assert snaps.capture(step, model, opt)  # the second and third refresh the plan's copies
    kept = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(8, 4))
    with torch.no_grad():
        model.body.weight.fill_(math.nan)
    assert (model.meta, model.head.scale) == ({"calls": 4}, 1.5**4)
    assert snaps.restore(model, opt) == 2
    assert (model.meta, model.head.scale) == ({"calls": 3}, 1.5**3)
    assert all(torch.equal(a, b) for a, b in zip(kept, model.parameters(), strict=True))


async def test_a_session_trains_a_model_with_extra_states() -> None:
    torch.manual_seed(0)
    model = _WithExtraState()
    opt = torch.optim.AdamW(model.parameters())
    recorder = RecordingSink()
    async with session_for(model, opt, recorder) as session:
        for step in range(60):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            verdict = await session.check_step(step, loss=loss)
            if verdict.should_step:
                opt.step()
            opt.zero_grad()
            await session.step_completed(step, loss=verdict.loss)
    assert session.recovery is not None
    assert recorder.of_type(RecoveryApplied) == []


def test_a_module_keeping_the_extra_state_it_is_given_cannot_change_the_snapshot() -> None:
    class Keeps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.meta: dict[str, int] = {"v": 1}

        def get_extra_state(self) -> dict[str, int]:
            return self.meta

        def set_extra_state(self, state: dict[str, int]) -> None:
            self.meta = state  # kept as given

    model = Keeps()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snaps = StateSnapshots()
    assert snaps.capture(0, model, opt)
    model.meta["v"] = 2  # the live object: the snapshot holds its own copy
    assert snaps.restore(model, opt) == 0 and model.meta == {"v": 1}
    model.meta["v"] = 3  # the object a restore gave: still not the snapshot's
    assert snaps.restore(model, opt) == 0 and model.meta == {"v": 1}


def test_a_saved_snapshot_with_extra_state_loads_as_a_checkpoint(tmp_path: object) -> None:
    torch.manual_seed(0)
    model = _WithExtraState()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = _saved(model, opt, 7, f"{tmp_path}/extra.pt")
    model.meta = {"calls": 99}
    loaded = StateSnapshots(checkpoint=path)  # weights_only=True: a dict of ints loads
    assert loaded.restore(model, opt) == 7 and model.meta == {"calls": 0}


class _Adapted(nn.Module):
    """A LoRA-style fine-tune: a large frozen base and a small trainable adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(64, 64)
        self.base.requires_grad_(False)
        self.down = nn.Linear(64, 2, bias=False)
        self.up = nn.Linear(2, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x) + self.up(self.down(x))
        return y


def _adapted() -> tuple[_Adapted, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Adapted()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)  # the frozen ones get no gradient
    for _ in range(2):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


class TestFrozen:
    def test_frozen_parameters_are_not_copied(self) -> None:
        """A LoRA fine-tune of a 7 B model would copy 14 GB of weights that never change."""
        model, opt = _adapted()
        snaps = StateSnapshots()
        assert snaps.capture(0, model, opt)
        adapter = 2 * 64 * 2 * 4  # down and up, float32
        assert snaps.placement is not None
        assert snaps.placement.nbytes == 3 * adapter + 2 * 4  # weights, two moments, 2 steps

    def test_a_restore_mends_the_trainable_and_leaves_the_frozen_as_they_are(self) -> None:
        model, opt = _adapted()
        snaps = StateSnapshots()
        assert snaps.capture(0, model, opt)
        base = model.base.weight
        kept = model.down.weight.detach().clone()
        with torch.no_grad():
            model.down.weight.fill_(math.nan)
        assert snaps.restore(model, opt) == 0
        assert torch.equal(model.down.weight, kept) and model.base.weight is base

    def test_a_non_finite_frozen_parameter_is_refused_naming_it(self) -> None:
        model, opt = _adapted()
        snaps = StateSnapshots()
        assert snaps.capture(0, model, opt)
        with torch.no_grad():
            model.base.weight[0, 0] = math.nan
            model.down.weight.fill_(1.0)
        with pytest.raises(
            NoGoodStateError, match=r"frozen parameters are non-finite \('base.weight'\)"
        ):
            snaps.restore(model, opt)
        assert torch.equal(model.down.weight, torch.ones(2, 64))  # nothing restored

    def test_a_parameter_unfrozen_since_is_in_the_next_snapshot(self) -> None:
        model, opt = _adapted()
        snaps = StateSnapshots(every=1)
        assert snaps.capture(0, model, opt)
        model.base.requires_grad_(True)  # unfrozen, in the optimizer all along
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        assert snaps.capture(1, model, opt)  # planned again: the base is copied now
        kept = model.base.weight.detach().clone()
        with torch.no_grad():
            model.base.weight.fill_(math.nan)
        assert snaps.restore(model, opt) == 1 and torch.equal(model.base.weight, kept)

    def test_a_saved_snapshot_without_the_frozen_loads_as_a_checkpoint(
        self, tmp_path: object
    ) -> None:
        model, opt = _adapted()
        path = _saved(model, opt, 5, f"{tmp_path}/adapter.pt")
        kept = model.up.weight.detach().clone()
        with torch.no_grad():
            model.up.weight.fill_(math.nan)
        assert StateSnapshots(checkpoint=path).restore(model, opt) == 5
        assert torch.equal(model.up.weight, kept)


async def test_the_report_lists_that_no_last_good_state_is_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    """What a user reads after the run: the log's report has the warning in its incidents."""
    monkeypatch.setattr(_placement, "host_available", lambda: 16)
    model, opt, x, y = classifier()
    log_dir = f"{tmp_path}/logs"
    async with Session(model, opt, log_dir=log_dir, alerts=False, system_interval=None) as session:
        await train(session, model, opt, x, y, 5)
    summary, _ = build_report(log_dir, html=False)
    rows = [r for r in summary.incidents if r.kind == "snapshot_placed"]
    assert len(rows) == 1 and rows[0].severity == "warning" and rows[0].step == 0
    assert "host cannot hold it" in rows[0].message


def test_an_optimizer_whose_state_needs_a_collective_is_left_out_and_said(
    tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    """``ZeroRedundancyOptimizer.state_dict()`` raises unless every rank consolidated first: it
    raised out of the safe point at the first good step. The snapshot holds the model alone."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        snaps = StateSnapshots(every=1)
        with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
            assert snaps.capture(0, model, opt) and snaps.capture(1, model, opt)
        said = [r for r in caplog.records if "snapshot_without_optimizer_state" in r.getMessage()]
        assert len(said) == 1 and "consolidate_state_dict" in said[0].getMessage()
        kept = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.fill_(math.nan)
        assert snaps.restore(model, opt) == 1 and torch.equal(model.weight, kept)
    finally:
        dist.destroy_process_group()


async def _skipped(
    session: Session,
    opt: torch.optim.Optimizer,
    steps: int,
    loss_of: Callable[[int], torch.Tensor],
) -> list[int]:
    """Train *steps* steps on ``loss_of(step)``; the steps the session said not to take."""
    skipped: list[int] = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(step)
        loss.backward()  # type: ignore[no-untyped-call]
        verdict = await session.check_step(step, loss=loss)
        if verdict.should_step:
            opt.step()
        else:
            skipped.append(step)
        await session.step_completed(step, loss=verdict.loss)
    return skipped


class _WithSide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.side = nn.Linear(2, 2)  # trained elsewhere: its gradient is not ours to drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.body(x)
        return y


async def test_a_skip_clears_the_nan_gradients_of_parameters_outside_the_optimizer() -> None:
    """An optimizer over the weights only (Muon-style: 2-D parameters): the loop's
    ``optimizer.zero_grad()`` never clears the biases, so a skipped NaN step's gradient stayed
    in them and every later step was non-finite and skipped. A finite one stays theirs."""
    torch.manual_seed(0)
    model = _WithSide()
    side = torch.full((2, 2), 2.0)
    model.side.weight.grad = side.clone()
    opt = torch.optim.SGD([p for p in model.body.parameters() if p.dim() == 2], lr=0.01)
    x = torch.randn(16, 4)
    async with session_for(model, opt, RecordingSink()) as session:
        skipped = await _skipped(
            session, opt, 12, lambda step: model(x).pow(2).mean() * (math.nan if step == 5 else 1)
        )
    assert skipped == [5]
    grads = [p.grad for p in model.body.parameters() if p.grad is not None]
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(model.side.weight.grad, side)


class TestLooseParameters:
    """A parameter the optimizer trains beside the model (a learnable temperature, as CLIP
    keeps its logit scale): in no state dict of the model. A NaN written into it was never
    restored: every later step was skipped, for good, and the run never stopped."""

    @staticmethod
    def _setup() -> tuple[nn.Module, nn.Parameter, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        temperature = nn.Parameter(torch.ones(()))
        opt = torch.optim.AdamW([*model.parameters(), temperature], lr=0.01)
        return model, temperature, opt

    def test_it_is_copied_refused_when_not_finite_and_restored(self) -> None:
        model, temperature, opt = self._setup()
        (model(torch.randn(8, 4)) * temperature).pow(2).mean().backward()
        opt.step()
        snaps = StateSnapshots(every=1)
        assert snaps.capture(0, model, opt)
        kept = temperature.detach().clone()
        with torch.no_grad():
            temperature.fill_(math.nan)
        assert not snaps.capture(1, model, opt)  # a NaN state is never taken
        assert snaps.restore(model, opt) == 0 and torch.equal(temperature, kept)

    async def test_a_session_restores_it_and_trains_on(self) -> None:
        model, temperature, opt = self._setup()
        x = torch.randn(16, 4)

        def loss_of(step: int) -> torch.Tensor:
            if step == 30:
                with torch.no_grad():
                    temperature.fill_(math.nan)
            loss: torch.Tensor = (model(x) * temperature).pow(2).mean()
            return loss

        async with session_for(model, opt, RecordingSink()) as session:
            skipped = await _skipped(session, opt, 50, loss_of)
        assert skipped == [30, 31, 32]  # the third NaN step in a row restores the state
        assert bool(torch.isfinite(temperature))
