"""A restore is all or nothing: a held state that no longer fits is refused before anything is
written, and a load that fails part-way is undone.

Before, ``StateSnapshots.restore`` called ``model.load_state_dict`` and then
``optimizer.load_state_dict``: after a layer was added or replaced, a parameter reshaped, a
buffer added or removed, or a param group added since a checkpoint was loaded, it raised
part-way, with the model restored and the optimizer not, or the model half loaded (torch copies
every entry that fits before it raises about the others), and the safe point let the internal
``RuntimeError``/``ValueError`` out into the training loop.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from eventbus_debug import Session, TrainingStopped
from eventbus_debug.events import RecoveryAction, RecoveryApplied, StepSkipped
from eventbus_debug.recovery import NoGoodStateError, StateSnapshots
from eventbus_debug.testing import RecordingSink

QUIET: dict[str, Any] = {"log_dir": None, "system_interval": None, "report": False}


def _model() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=gen, dtype=dtype)).pow(2).mean().backward()
        opt.step()


def _linear(model: nn.Sequential, i: int) -> nn.Linear:
    layer = model[i]
    assert isinstance(layer, nn.Linear)
    return layer


def _fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything a restore may write: model entries, optimizer state and groups (cloned), and
    the identities of the live tensors and dicts (an undone load must leave the same objects)."""
    state: dict[int, dict[str, Any]] = {}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        state[i] = {
            k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
            for k, v in opt.state.get(p, {}).items()
        }
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "model_ids": [id(t) for t in model.state_dict(keep_vars=True).values()],
        "state": state,
        "state_ids": [id(v) for s in opt.state.values() for v in s.values()],
        "groups": [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups
        ],
        "group_ids": [id(g) for g in opt.param_groups],
        "members": [[id(p) for p in g["params"]] for g in opt.param_groups],
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and (torch.equal(a, b) or bool(torch.isclose(a, b, 0, 0, equal_nan=True).all()))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _captured(seed: int = 1) -> tuple[nn.Sequential, torch.optim.Optimizer, StateSnapshots]:
    model, opt = _model()
    _train(model, opt, 2, seed=seed)
    snaps = StateSnapshots(every=1)
    assert snaps.capture(2, model, opt)
    return model, opt, snaps


# -- the structural changes ---------------------------------------------------------------------


def _layer_added(model: nn.Sequential, opt: torch.optim.Optimizer) -> None:
    extra = nn.Linear(1, 1)
    model.append(extra)
    opt.add_param_group({"params": list(extra.parameters())})


def _layer_replaced(model: nn.Sequential, opt: torch.optim.Optimizer) -> None:
    """A wider head, its parameters swapped into the optimizer's group (state reset)."""
    old = _linear(model, 3)
    new = nn.Linear(8, 2)
    model[3] = nn.Sequential(new, nn.Flatten(0))  # keys change too: 3.weight -> 3.0.weight
    group = opt.param_groups[0]
    group["params"] = [p for p in group["params"] if p is not old.weight and p is not old.bias]
    group["params"] += list(new.parameters())
    opt.state.pop(old.weight, None)
    opt.state.pop(old.bias, None)


def _head_widened(model: nn.Sequential, opt: torch.optim.Optimizer) -> None:
    """Same keys, new shapes: the head's parameters reshaped in place, their state reset."""
    head = _linear(model, 3)
    with torch.no_grad():
        head.weight.data = torch.zeros(2, 8)
        head.bias.data = torch.zeros(2)
    opt.state.pop(head.weight, None)
    opt.state.pop(head.bias, None)
    model.append(nn.Flatten(0))


def _buffer_added(model: nn.Sequential, opt: torch.optim.Optimizer) -> None:
    model[0].register_buffer("scale", torch.ones(4))


def _buffer_removed(model: nn.Sequential, opt: torch.optim.Optimizer) -> None:
    """BatchNorm without running statistics from now on (it normalizes with the batch's)."""
    norm = model[1]
    assert isinstance(norm, nn.BatchNorm1d)
    norm.running_mean = None
    norm.running_var = None


def _buffer_kind_changed(model: nn.Sequential, opt: torch.optim.Optimizer) -> None:
    """An integer buffer now floating: copying the snapshot in would cast it silently."""
    model[1].num_batches_tracked = torch.zeros((), dtype=torch.float32)


CHANGES: dict[str, tuple[Callable[[nn.Sequential, torch.optim.Optimizer], None], str]] = {
    "layer_added": (_layer_added, "added since: '4.weight', '4.bias'"),
    "layer_replaced": (_layer_replaced, "removed since: '3.weight', '3.bias'"),
    "parameter_reshaped": (_head_widened, "'3.weight': shape (1, 8) at the snapshot, (2, 8) now"),
    "buffer_added": (_buffer_added, "added since: '0.scale'"),
    "buffer_removed": (_buffer_removed, "removed since: '1.running_mean', '1.running_var'"),
    "buffer_dtype_kind": (
        _buffer_kind_changed,
        "'1.num_batches_tracked': dtype torch.int64 at the snapshot, torch.float32 now",
    ),
}


class TestRefusedBeforeAnythingIsWritten:
    @pytest.mark.parametrize("change", list(CHANGES))
    def test_a_structural_change_leaves_model_and_optimizer_untouched(self, change: str) -> None:
        model, opt, snaps = _captured()
        apply, names = CHANGES[change]
        apply(model, opt)
        _train(model, opt, 2, seed=7)  # the live state moves away from the snapshot
        before = _fingerprint(model, opt)
        with pytest.raises(NoGoodStateError, match="does not fit") as caught:
            snaps.restore(model, opt)
        assert names in str(caught.value)
        assert "nothing was restored" in str(caught.value)
        assert _same(_fingerprint(model, opt), before)
        assert snaps.restores == 0
        assert snaps.failed_restores == 1
        _train(model, opt, 1, seed=8)  # the loop trains on, and the next capture fits
        assert snaps.maybe_capture(5, model, opt)  # at once: the held state is stale
        expected = _fingerprint(model, opt)
        _train(model, opt, 2, seed=9)
        assert snaps.restore(model, opt) == 5
        assert _same(_fingerprint(model, opt)["model"], expected["model"])
        assert _same(_fingerprint(model, opt)["state"], expected["state"])

    def test_a_param_group_added_since_a_checkpoint_was_loaded(self, tmp_path: Path) -> None:
        """A checkpoint has no parameter identities: its groups must match the optimizer's.
        Before: the model was loaded, then ValueError (different number of parameter groups)."""
        model, opt, snaps = _captured()
        snaps.save(tmp_path / "good.pt")
        held = StateSnapshots(checkpoint=tmp_path / "good.pt")
        extra = nn.Parameter(torch.zeros(3))
        opt.add_param_group({"params": [extra], "lr": 1e-3})
        _train(model, opt, 2, seed=7)
        before = _fingerprint(model, opt)
        with pytest.raises(NoGoodStateError, match="param groups") as caught:
            held.restore(model, opt)
        assert "param groups: sizes [6, 1] now, [6] at the snapshot" in str(caught.value)
        assert _same(_fingerprint(model, opt), before)

    def test_an_optimizer_only_parameter_reshaped(self) -> None:
        """A parameter the optimizer trains outside the model (a learnable temperature):
        before, its old-shaped moments were loaded silently and the next optimizer.step()
        raised (output with shape [1] doesn't match the broadcast shape [3])."""
        model, _ = _model()
        temperature = nn.Parameter(torch.ones(1))
        opt = torch.optim.AdamW([*model.parameters(), temperature], lr=1e-2)

        def train(steps: int) -> None:
            for _ in range(steps):
                opt.zero_grad()
                out = model(torch.randn(8, 4)) * temperature.sum()
                out.pow(2).mean().backward()
                opt.step()

        train(2)
        snaps = StateSnapshots(every=1)
        assert snaps.capture(2, model, opt)
        temperature.data = torch.ones(3)
        opt.state.pop(temperature)
        train(2)
        before = _fingerprint(model, opt)
        with pytest.raises(NoGoodStateError, match="does not fit") as caught:
            snaps.restore(model, opt)
        assert "optimizer state 'exp_avg' of parameter 6 (not in the model)" in str(caught.value)
        assert "shape (1,) at the snapshot, parameter shape (3,) now" in str(caught.value)
        assert _same(_fingerprint(model, opt), before)
        train(1)  # and the optimizer still steps

    def test_a_param_group_added_in_memory_still_restores(self) -> None:
        """``add_param_group`` since an in-memory capture is not a mismatch: each parameter
        gets its state back by identity (``_remapped``)."""
        model, opt, snaps = _captured()
        extra = nn.Parameter(torch.zeros(3))
        opt.add_param_group({"params": [extra], "lr": 1e-3})
        _train(model, opt, 2, seed=7)
        assert snaps.restore(model, opt) == 2
        assert extra not in opt.state

    def test_a_dtype_change_is_restored_in_the_new_dtype(self) -> None:
        """``model.double()`` since the capture: the values come back in the model's dtype (as
        load_state_dict casts them), the optimizer moments too."""
        model, opt, snaps = _captured()
        expected = _fingerprint(model, opt)
        model.double()
        for state in opt.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                state[k] = state[k].double()
        _train(model, opt, 2, seed=7)
        assert snaps.restore(model, opt) == 2
        after = _fingerprint(model, opt)
        for k, v in expected["model"].items():
            live = after["model"][k]
            assert live.dtype == (torch.float64 if v.is_floating_point() else v.dtype)
            assert torch.equal(live, v.to(live.dtype))
        weight = _linear(model, 0).weight
        assert opt.state[weight]["exp_avg"].dtype == torch.float64
        _train(model, opt, 1, seed=8)

    def test_the_refusal_is_logged_once_per_restore(self, caplog: pytest.LogCaptureFixture) -> None:
        model, opt, snaps = _captured()
        _buffer_added(model, opt)
        with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
            with pytest.raises(NoGoodStateError):
                snaps.restore(model, opt)
        refused = [r for r in caplog.records if r.getMessage().startswith("restore_refused")]
        assert len(refused) == 1
        assert "0.scale" in refused[0].getMessage()


class _Boom(RuntimeError):
    pass


class TestUndoneWhenTheLoadFailsPartWay:
    def test_an_optimizer_load_hook_that_raises(self) -> None:
        """The model was loaded and the optimizer's state replaced when its post-hook raised:
        both are put back, the optimizer's own tensors and dicts included."""
        model, opt, snaps = _captured()
        _train(model, opt, 2, seed=7)
        before = _fingerprint(model, opt)

        def hook(optimizer: torch.optim.Optimizer) -> None:
            raise _Boom("hook failed")

        opt.register_load_state_dict_post_hook(hook)
        with pytest.raises(NoGoodStateError, match="failed part-way") as caught:
            snaps.restore(model, opt)
        assert isinstance(caught.value.__cause__, _Boom)
        assert "put back as they were" in str(caught.value)
        assert _same(_fingerprint(model, opt), before)
        assert snaps.restores == 0 and snaps.failed_restores == 1

    def test_a_module_load_hook_that_raises(self) -> None:
        """A module's load post-hook runs after every entry was copied: the copies are undone."""
        model, opt, snaps = _captured()
        _train(model, opt, 2, seed=7)
        before = _fingerprint(model, opt)

        def hook(module: nn.Module, keys: Any) -> None:
            raise _Boom("module hook failed")

        model.register_load_state_dict_post_hook(hook)  # type: ignore[no-untyped-call]
        with pytest.raises(NoGoodStateError, match="failed part-way"):
            snaps.restore(model, opt)
        assert _same(_fingerprint(model, opt), before)

    def test_an_interrupt_is_undone_and_not_wrapped(self) -> None:
        model, opt, snaps = _captured()
        _train(model, opt, 2, seed=7)
        before = _fingerprint(model, opt)

        def hook(optimizer: torch.optim.Optimizer) -> None:
            raise KeyboardInterrupt

        opt.register_load_state_dict_post_hook(hook)
        with pytest.raises(KeyboardInterrupt):
            snaps.restore(model, opt)
        assert _same(_fingerprint(model, opt), before)


# -- through a Session --------------------------------------------------------------------------


def _session_model() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batch(gen: torch.Generator, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 1, generator=gen)
    if bad:
        x[0, 0] = math.nan
    return x, y


@pytest.mark.anyio
async def test_session_precautionary_restore_refused_skips_and_trains_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three NaN batches in a row after a buffer was added: the precautionary restore does not
    fit, so nothing is restored, the step is skipped and says why, a warning is logged, and the
    loop trains on (before: RuntimeError out of check_step, the model half loaded)."""
    model, opt = _session_model()
    log = RecordingSink()
    gen = torch.Generator().manual_seed(3)
    stepped: list[bool] = []
    with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
        async with Session(model, opt, **QUIET) as session:
            session.bus.subscribe(log)
            for step in range(10):
                if step == 3:
                    model[0].register_buffer("scale", torch.ones(4))
                if step == 6:
                    before = _fingerprint(model, opt)
                x, y = _batch(gen, bad=step in {4, 5, 6})
                loss = nn.functional.mse_loss(model(x), y)
                torch.autograd.backward(loss)
                verdict = await session.check_step(step, loss=loss)
                if step == 6:
                    assert _same(_fingerprint(model, opt)["model"], before["model"])
                    assert _same(_fingerprint(model, opt)["state"], before["state"])
                stepped.append(verdict.should_step)
                if verdict.should_step:
                    opt.step()
                opt.zero_grad()
                await session.step_completed(step)
            await session.bus.drain()
    assert stepped == [True, True, True, True, False, False, False, True, True, True]
    restores = [e for e in log.of_type(RecoveryApplied) if e.action is RecoveryAction.RESTORE_STATE]
    assert [(e.step, e.outcome) for e in restores] == [(6, "skipped")]
    assert "does not fit" in restores[0].detail and "'0.scale'" in restores[0].detail
    assert {e.step for e in log.of_type(StepSkipped)} == {4, 5, 6}
    assert any(r.getMessage().startswith("restore_refused") for r in caplog.records)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.anyio
async def test_session_required_restore_refused_stops_with_the_reason() -> None:
    """A NaN written into a weight after the head was widened: the state that could bring the
    model back does not fit, so training stops (TrainingStopped, as when no good state exists)
    naming the change, and the model is not half loaded (before: RuntimeError, size mismatch,
    with every other entry already overwritten)."""
    model, opt = _session_model()
    gen = torch.Generator().manual_seed(3)
    log = RecordingSink()
    with pytest.raises(TrainingStopped, match=r"'2\.weight': shape \(1, 8\)"):
        async with Session(model, opt, **QUIET) as session:
            session.bus.subscribe(log)
            for step in range(8):
                if step == 3:
                    head = model[2]
                    assert isinstance(head, nn.Linear)
                    head.weight.data = torch.zeros(2, 8)
                    head.bias.data = torch.zeros(2)
                    opt.state.pop(head.weight, None)
                    opt.state.pop(head.bias, None)
                if step == 4:
                    with torch.no_grad():
                        _linear(model, 0).weight[0, 0] = math.nan
                    before = _fingerprint(model, opt)
                x, y = _batch(gen)
                loss = nn.functional.mse_loss(model(x).mean(dim=1, keepdim=True), y)
                torch.autograd.backward(loss)
                try:
                    verdict = await session.check_step(step, loss=loss)
                except TrainingStopped:
                    after = _fingerprint(model, opt)
                    assert _same(after["model"], before["model"])
                    assert _same(after["state"], before["state"])
                    raise
                if verdict.should_step:
                    opt.step()
                opt.zero_grad()
                await session.step_completed(step)
    failed = [e for e in log.of_type(RecoveryApplied) if e.outcome == "failed"]
    assert failed and "does not fit" in failed[0].detail


def test_a_snapshot_keeps_the_modules_state_versions() -> None:
    """Without its ``_metadata`` a snapshot loads as a state dict of an old format: BatchNorm
    then adds a ``num_batches_tracked`` of its own, which a module whose counter is ``None``
    refuses ("Unexpected key"). Kept, the restore loads as the capture saved."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    bn = model[1]
    assert isinstance(bn, nn.BatchNorm1d)
    bn.num_batches_tracked = None  # counts no batches: momentum alone weighs the stats
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 2)
    snapshots = StateSnapshots()
    assert snapshots.capture(2, model, opt)
    running = bn.running_mean
    assert running is not None
    mean = running.detach().clone()
    _train(model, opt, 3)
    assert not torch.equal(running, mean)
    assert snapshots.restore(model, opt) == 2
    assert torch.equal(running, mean)
    assert snapshots.failed_restores == 0


def test_common_fixes_report_a_state_that_no_longer_fits() -> None:
    """``apply_common_fixes`` with a held state the model outgrew: the parameters are reported
    unrepaired (never zeroed, never half restored), no error escapes."""
    from eventbus_debug.recovery import apply_common_fixes

    model, opt = _model()
    _train(model, opt, 2)
    snapshots = StateSnapshots()
    assert snapshots.capture(2, model, opt)
    model.append(nn.Linear(1, 1))  # the structure changed since the capture
    first = model[0]
    assert isinstance(first, nn.Linear)
    with torch.no_grad():
        first.weight[0, 0] = math.nan
    before = copy.deepcopy(model.state_dict())
    fixes = apply_common_fixes(model, opt, snapshots=snapshots)
    assert not fixes.healthy
    assert fixes.restored_step is None
    assert "0.weight" in fixes.unrepaired_parameters
    assert "could not be restored" in fixes.details[0]
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) or k == "0.weight" for k in before)
    assert torch.isnan(after["0.weight"][0, 0])
