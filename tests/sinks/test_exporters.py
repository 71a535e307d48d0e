"""The TensorBoard and W&B exporters, end to end: a short session, then the files read back."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from torch import nn

from eventbus_debug import Session
from eventbus_debug.events import (
    Event,
    GradientExploded,
    NonFiniteDetected,
    StepCompleted,
    TensorRole,
)
from eventbus_debug.typing import BatchSink

pytest.importorskip("tensorboard")


async def _train(sink: BatchSink[Event], steps: int = 12, nan_step: int = 6) -> None:
    """A tiny seeded run at ADVANCED level with a NaN injected at *nan_step*."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    async with Session(
        model,
        optimizer,
        log_dir=None,
        level="advanced",
        sinks=[sink],
        report=False,
        alerts=False,
        system_interval=None,
    ) as session:
        for step in range(steps):
            x = torch.randn(16, 4)
            if step == nan_step:
                x[0, 0] = math.nan
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            if (await session.check_step(step, loss=loss)).should_step:
                optimizer.step()
            await session.step_completed(step, loss=loss.item(), learning_rate=0.05, samples=16)


def test_importing_sinks_imports_no_exporter() -> None:
    """`import sinks` loads neither tensorboard nor wandb (checked in a fresh interpreter)."""
    code = (
        "import sys, sinks; "
        "bad = [m for m in ('tensorboard', 'wandb', 'torch.utils.tensorboard', 'eventbus_debug.sinks.wandb') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


class TestTensorBoard:
    async def test_session_scalars_and_incidents_read_back(self, tmp_path: Path) -> None:
        """Loss, gradient norm, LR, throughput, per-layer norms and the NaN incident are in TensorBoard."""
        from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped,unused-ignore]
            EventAccumulator,
        )

        from eventbus_debug.sinks import TensorBoardSink

        sink = TensorBoardSink(tmp_path / "tb")
        await _train(sink)
        assert sink.written > 0
        acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        assert {
            "train/loss",
            "train/learning_rate",
            "train/samples_per_s",
            "check/grad_norm",
            "incidents/non_finite_detected",
        } <= tags
        assert any(t.startswith("layers/grad_norm/") for t in tags)
        assert any(t.startswith("layers/update_ratio/") for t in tags)
        losses = {e.step: e.value for e in acc.Scalars("train/loss")}
        assert sorted(losses) == list(range(12))
        assert math.isnan(losses[6])  # the NaN step is shown as NaN, not dropped
        assert next(e.step for e in acc.Scalars("incidents/non_finite_detected")) == 6
        texts = [
            (e.step, e.tensor_proto.string_val[0].decode())
            for e in acc.Tensors("incidents/text_summary")
        ]
        assert texts and texts[0][0] == 6 and "non_finite_detected" in texts[0][1]

    async def test_close_twice_and_refuse_after(self, tmp_path: Path) -> None:
        """aclose is idempotent; a closed sink refuses events."""
        from eventbus_debug.sinks import TensorBoardSink

        sink = TensorBoardSink(tmp_path)
        await sink.handle(StepCompleted(step=1, loss=0.5))
        await sink.aclose()
        await sink.aclose()
        with pytest.raises(RuntimeError, match="is closed"):
            await sink.handle(StepCompleted(step=2, loss=0.5))

    def test_bad_arguments(self, tmp_path: Path) -> None:
        """Bad arguments are refused with a message naming them."""
        from eventbus_debug.sinks import TensorBoardSink

        with pytest.raises(TypeError, match="log_dir must be a path"):
            TensorBoardSink(3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="flush_secs must be a positive number"):
            TensorBoardSink(tmp_path, flush_secs=0)


async def _finished_records(run_dir: Path) -> list[Any]:
    """The run's records once its exit record is written (finish may outlive the bus close)."""
    with anyio.fail_after(60):
        while True:
            records = _wandb_records(run_dir)
            if any(r.WhichOneof("record_type") == "exit" for r in records):
                return records
            await anyio.sleep(0.05)


def _wandb_records(run_dir: Path) -> list[Any]:
    """The protobuf records of an offline run's .wandb file (LevelDB log format)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # full
            out.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            out.append(pending + chunk)
    records = []
    for raw in out:
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined,unused-ignore]
        record.ParseFromString(raw)
        records.append(record)
    return records


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """wandb.init arguments for an offline run in tmp_path (no network, no stdout capture)."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return {
        "project": "eventbus-debug-tests",
        "mode": "offline",
        "dir": str(tmp_path),
        "settings": wandb.Settings(console="off", silent=True),
    }


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TestWandb:
    async def test_session_logs_scalars_and_alerts_offline(
        self, tmp_path: Path, offline: dict[str, Any]
    ) -> None:
        """An offline run holds the loss history, per-layer norms and alerts for the NaN only."""
        from eventbus_debug.sinks import WandbSink

        sink = WandbSink(**offline)
        run_dir = Path(sink.run.dir).parent
        await _train(sink)
        assert sink.alerts >= 1
        records = await _finished_records(run_dir)
        history = [
            {item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
            for r in records
            if r.WhichOneof("record_type") == "history"
        ]
        losses = {int(h["step"]): h["train/loss"] for h in history if "train/loss" in h}
        assert sorted(losses) == list(range(12))
        assert losses[6] == "NaN"
        assert any(k.startswith("layers/grad_norm/") for h in history for k in h)
        alerts = [r.alert for r in records if r.WhichOneof("record_type") == "alert"]
        # The loss and the gradients of step 6: one alert, the repeat reported at close.
        # The close-time count has a title of its own (W&B suppresses a title repeated
        # within wait_duration).
        assert [a.title for a in alerts] == [
            "non_finite_detected",
            "non_finite_detected (held back)",
        ]
        assert "step 6" in alerts[0].text and "non-finite" in alerts[0].text
        assert "1 more non_finite_detected incident(s) held back" in alerts[1].text

    async def test_alert_cooldown_counts_repeats(self, offline: dict[str, Any]) -> None:
        """Repeats within the cooldown are held back, then reported with the next alert."""
        from eventbus_debug.sinks import WandbSink

        clock = FakeClock()
        sink = WandbSink(alert_cooldown=60.0, clock=clock, **offline)
        run_dir = Path(sink.run.dir).parent

        def explosion(step: int) -> GradientExploded:
            return GradientExploded(step=step, total_norm=1e4, threshold=10.0)

        for step in range(5):
            clock.now += 1.0
            await sink.handle(explosion(step))
        await sink.handle(
            NonFiniteDetected(step=5, role=TensorRole.LOSS, names=("loss",))
        )  # another kind: its own cooldown
        clock.now += 120.0
        await sink.handle(explosion(9))
        await sink.aclose()
        alerts = [
            r.alert
            for r in await _finished_records(run_dir)
            if r.WhichOneof("record_type") == "alert"
        ]
        assert [a.title for a in alerts] == [
            "gradient_exploded",
            "non_finite_detected",
            "gradient_exploded",
        ]
        assert "(4 more since the last alert)" in alerts[2].text
        assert sink.alerts == 3

    def test_bad_arguments(self, offline: dict[str, Any]) -> None:
        """Bad arguments are refused before any run starts."""
        from eventbus_debug.sinks import WandbSink

        with pytest.raises(ValueError, match="alert_cooldown must be a number"):
            WandbSink(alert_cooldown=-1, **offline)
        with pytest.raises(TypeError, match="alert_min_severity must be a Severity"):
            WandbSink(alert_min_severity="error", **offline)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"either a run or wandb\.init arguments"):
            WandbSink(object(), project="x")
