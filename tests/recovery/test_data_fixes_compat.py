"""Corrupt samples skipped and reported, apply_common_fixes, and the seeds' ErrorHandler names."""

from __future__ import annotations

import math

import anyio
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from eventbus_debug import (
    CallState,
    EventBus,
    RecoveryEngine,
    Session,
    SyncEventBus,
    SyncSession,
    TrainingStopped,
)
from eventbus_debug.compat import DebugDecorator, ErrorHandler
from eventbus_debug.events import RecoveryAction, RecoveryApplied, SampleSkipped
from eventbus_debug.recovery import (
    CorruptDataError,
    StateSnapshots,
    apply_common_fixes,
    skip_corrupt_samples,
)
from eventbus_debug.testing import RecordingSink

from ._loop import all_finite, make

BAD: frozenset[int] = frozenset({3, 17, 18})


class FlakyDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """32 regression samples; indices in *bad* raise like an undecodable file would."""

    def __init__(self, bad: frozenset[int] = BAD) -> None:
        torch.manual_seed(0)
        self.x = torch.randn(32, 4)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.bad = bad

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index in self.bad:
            raise ValueError(f"cannot decode sample {index}: truncated file")
        return self.x[index], self.y[index]


class TestCorruptSamples:
    async def test_training_skips_and_reports_known_bad_indices(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """Two epochs over a dataset with 3 bad samples: 29 samples trained per epoch, 6 reports."""
        bus.subscribe(recorder)
        model, opt, _, _ = make()
        loader = skip_corrupt_samples(FlakyDataset(), bus, max_skipped=3, batch_size=8)
        seen = 0
        with anyio.fail_after(30):
            for _ in range(2):
                for x, y in loader:
                    seen += len(x)
                    nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
                    opt.step()
                    opt.zero_grad()
            await bus.drain()
        assert seen == 2 * 29
        skipped = recorder.of_type(SampleSkipped)
        assert [s.index for s in skipped] == [3, 17, 18, 3, 17, 18]
        assert [s.skipped for s in skipped] == [1, 2, 3, 1, 2, 3]  # counted per pass
        assert skipped[0].error_type == "ValueError"
        assert skipped[0].message == "cannot decode sample 3: truncated file"
        assert [c.index for c in loader.skipped] == [3, 17, 18]
        assert all_finite(model)

    async def test_too_many_corrupt_samples_raise(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """max_skipped=2 with 3 bad samples: CorruptDataError at the third, naming the indices."""
        bus.subscribe(recorder)
        loader = skip_corrupt_samples(FlakyDataset(), bus, max_skipped=2, batch_size=8)
        with pytest.raises(
            CorruptDataError, match=r"3 corrupt samples .* max_skipped=2 .*3, 17, 18"
        ):
            for _ in loader:
                pass
        await bus.drain()
        assert len(recorder.of_type(SampleSkipped)) == 3  # the one over the bound is reported too

    def test_a_batch_of_only_bad_samples_is_left_out_and_other_errors_propagate(self) -> None:
        """batch_size=1: the bad samples' batches vanish; an uncaught type propagates."""
        loader = skip_corrupt_samples(FlakyDataset(), None, max_skipped=5, batch_size=1)
        assert sum(1 for _ in loader) == 29
        strict = skip_corrupt_samples(FlakyDataset(), None, catch=(KeyError,), batch_size=4)
        with pytest.raises(ValueError, match="cannot decode sample 3"):
            list(strict)
        with pytest.raises(ValueError, match="max_skipped"):
            skip_corrupt_samples(FlakyDataset(), None, max_skipped=-1)

    def test_worker_processes_report_in_the_main_process(self) -> None:
        """With num_workers=2 the markers cross processes and are published by the loader."""
        recorder = RecordingSink()
        with SyncEventBus() as bus:
            bus.subscribe(recorder)
            loader = skip_corrupt_samples(
                FlakyDataset(), bus, batch_size=8, num_workers=2, max_skipped=3
            )
            assert sum(len(x) for x, _ in loader) == 29
            bus.drain()
        assert sorted(s.index for s in recorder.of_type(SampleSkipped)) == [3, 17, 18]


class TestCommonFixes:
    def test_nan_parameter_restored_from_snapshot_and_reported(self) -> None:
        """A NaN weight with a snapshot: restored (not zeroed), grads dropped, report typed."""
        model, opt, x, y = make()
        snapshots = StateSnapshots()
        assert snapshots.capture(0, model, opt)
        good = model[0].weight.detach().clone()  # type: ignore[index]
        nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        with torch.no_grad():
            model[0].weight[1, 2] = math.nan  # type: ignore[index]
        fixes = apply_common_fixes(model, opt, snapshots=snapshots)
        assert "nan_parameter_fix" in fixes
        assert fixes.nonfinite_parameters == ("0.weight",)
        assert fixes.restored_step == 0 and fixes.healthy
        assert torch.equal(model[0].weight.detach(), good)  # type: ignore[index]
        assert all(p.grad is None for p in model.parameters())

    def test_nan_parameter_without_snapshot_is_reported_never_zeroed(self) -> None:
        """No good state: the NaN stays, the report says so; nothing is silently zeroed."""
        model, opt, _, _ = make()
        with torch.no_grad():
            model[2].bias.fill_(math.inf)  # type: ignore[index]
        fixes = apply_common_fixes(model, opt)
        assert fixes.unrepaired_parameters == ("2.bias",) and not fixes.healthy
        assert "no good state to restore" in fixes.details[0]
        assert math.isinf(float(model[2].bias.detach()[0]))  # type: ignore[index]

    async def test_exploding_grads_clipped_lr_lowered_zero_grads_named_and_published(
        self, bus: EventBus, recorder: RecordingSink
    ) -> None:
        """Gradients x1e4 → clipped to 1 and LR x0.5; a frozen-at-zero layer is named."""
        bus.subscribe(recorder)
        model, opt, x, y = make()
        (nn.functional.mse_loss(model(x), y) * 1e4).backward()  # type: ignore[no-untyped-call]
        model[2].bias.grad.zero_()  # type: ignore[index]
        fixes = apply_common_fixes(
            model, opt, max_grad_norm=1.0, lr_factor_on_explosion=0.5, bus=bus, step=7
        )
        norms = [float(p.grad.norm()) for p in model.parameters() if p.grad is not None]
        total = math.sqrt(sum(n * n for n in norms))
        assert fixes.fixes == ("exploding_gradient_fix", "zero_gradient_report")
        assert fixes.grad_norm is not None and fixes.grad_norm > 1e3
        assert fixes.clipped_to == 1.0 and total == pytest.approx(1.0, rel=1e-4)
        assert fixes.zero_gradients == ("2.bias",)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.025) and fixes.lr_factor == 0.5
        await bus.drain()
        applied = [(a.step, a.action) for a in recorder.of_type(RecoveryApplied)]
        assert applied == [
            (7, RecoveryAction.CLIP_GRADIENTS),
            (7, RecoveryAction.SCALE_LR),
            (7, RecoveryAction.CONTINUE),
        ]

    def test_nonfinite_and_stale_gradients_are_dropped_healthy_model_untouched(self) -> None:
        """Inf gradients are dropped; stale ones with zero_grads=True; a clean model: no fixes."""
        model, opt, x, y = make()
        nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        model[0].weight.grad[0, 0] = math.inf  # type: ignore[index]
        fixes = apply_common_fixes(model, opt)
        assert fixes.fixes == ("nonfinite_gradient_fix",) and fixes.nonfinite_gradients == (
            "0.weight",
        )
        assert all(p.grad is None for p in model.parameters())
        nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        assert apply_common_fixes(model, opt, max_grad_norm=None).fixes == ()
        stale = apply_common_fixes(model, opt, max_grad_norm=None, zero_grads=True)
        assert stale.fixes == ("stale_gradient_fix",)
        assert all(p.grad is None for p in model.parameters())
        with pytest.raises(ValueError, match="max_grad_norm"):
            apply_common_fixes(model, opt, max_grad_norm=0.0)


class TestSeedNames:
    def test_handle_error_shrinks_the_batch_then_hits_max_retries(self) -> None:
        """success, result = handler.handle_error(oom, 'train_step', max_retries=2)."""
        recorder = RecordingSink()
        with SyncEventBus() as bus:
            bus.subscribe(recorder)
            engine = RecoveryEngine(bus)
            handler = ErrorHandler(engine, state=CallState(batch_size=32))
            oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4 GiB")
            first = handler.handle_error(oom, "train_step", max_retries=2)
            success, result = handler.handle_error(oom, "train_step", max_retries=2)
            third = handler.handle_error(oom, "train_step", max_retries=2)
            unknown = handler.handle_error(ZeroDivisionError("x"), "eval")
            bus.drain()
        assert first.recovered and first.actions == (RecoveryAction.SHRINK_BATCH,)
        assert "batch_size 32 -> 16" in first.detail
        assert success is True and "batch_size 16 -> 8" in str(result)
        assert not third.recovered and "max_retries=2" in third.detail and third.attempt == 3
        assert handler.state.batch_size == 8
        assert not unknown.recovered and "no recovery strategy" in unknown.detail

    async def test_async_handle_error_reports_a_stop(self, bus: EventBus) -> None:
        """At the batch-size floor the strategies are exhausted: stop=True."""
        handler = ErrorHandler(RecoveryEngine(bus), state=CallState(batch_size=1))
        handled = await handler.ahandle_error(MemoryError("out of memory"), {"phase": "fwd"})
        assert handled.stop and not handled.recovered
        assert handled.actions == (RecoveryAction.STOP,)

    async def test_debug_decorator_retries_with_the_handler_state(self, bus: EventBus) -> None:
        """@DebugDecorator(handler, max_retries=3) reruns an OOMing step with a smaller batch."""
        model, opt, x, y = make()
        handler = ErrorHandler(RecoveryEngine(bus), state=CallState(batch_size=64))
        calls: list[int] = []

        @DebugDecorator(handler, max_retries=3)
        async def training_step() -> float:
            size = handler.state.batch_size
            assert size is not None
            calls.append(size)
            if size > 16:
                raise torch.OutOfMemoryError("CUDA out of memory")
            loss = nn.functional.mse_loss(model(x[:size]), y[:size])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
            return loss.item()

        with anyio.fail_after(30):
            assert math.isfinite(await training_step())
        assert calls == [64, 32, 16]

        @DebugDecorator(handler, max_retries=1)
        async def always_oom() -> None:
            raise torch.OutOfMemoryError("CUDA out of memory")

        handler.state.batch_size = 64
        with anyio.fail_after(30), pytest.raises(TrainingStopped, match="2 attempts"):
            await always_oom()
        with pytest.raises(ValueError, match="max_retries"):
            DebugDecorator(handler, max_retries=-1)


class TestSkippedSamplesCarryTheStep:
    async def test_inside_a_session_the_session_step_is_stamped(self) -> None:
        """SampleSkipped events published while a Session runs carry the session's step."""
        recorder = RecordingSink()
        model, opt, _, _ = make()
        async with EventBus() as bus:
            bus.subscribe(recorder)
            async with Session(model, opt, bus=bus, log_dir=None, recovery=False) as s:
                loader = skip_corrupt_samples(FlakyDataset(), bus, max_skipped=3, batch_size=8)
                for step, (x, y) in enumerate(loader):
                    await s.training_step(x, y, nn.functional.mse_loss, step=step + 10)
            await bus.drain()
        # batches 0 (index 3) and 2 (17, 18) are loaded after steps -, 10 and 11 completed
        assert [(e.index, e.step) for e in recorder.of_type(SampleSkipped)] == [
            (3, None),
            (17, 11),
            (18, 11),
        ]

    def test_sync_session_and_explicit_provider(self) -> None:
        """In a SyncSession the step is stamped too; an explicit step provider wins; outside
        any session the step stays None."""
        recorder = RecordingSink()
        model, opt, _, _ = make()
        with SyncSession(model, opt, log_dir=None, recovery=False) as s:
            s.bus.subscribe(recorder)
            s.step = 41
            list(skip_corrupt_samples(FlakyDataset(frozenset({0})), s.bus, batch_size=32))
            list(
                skip_corrupt_samples(
                    FlakyDataset(frozenset({1})), s.bus, batch_size=32, step=lambda: 7
                )
            )
            s.bus.drain()
        list(skip_corrupt_samples(FlakyDataset(frozenset({2})), None, batch_size=32))
        assert [(e.index, e.step) for e in recorder.of_type(SampleSkipped)] == [(0, 41), (1, 7)]
        with pytest.raises(TypeError, match="step must be a callable"):
            skip_corrupt_samples(FlakyDataset(), None, step=3)  # type: ignore[arg-type]
