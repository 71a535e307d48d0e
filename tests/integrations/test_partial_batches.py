"""The integrations tell the check how many samples each optimizer step averaged, so an
epoch's last batch of a few samples (``drop_last=False``) is judged as one
(tests/session/test_partial_batches.py): 10 samples in batches of 4 are steps of 4, 4 and 2;
with two micro-batches a step, 8 and 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from eventbus_debug import SyncSession


@pytest.fixture
def told(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The ``samples`` each ``SyncSession.check_step`` call was given."""
    seen: list[int | None] = []
    original = SyncSession.check_step

    def check_step(self: SyncSession, step: int, **kwargs: Any) -> Any:
        seen.append(kwargs.get("samples"))
        return original(self, step, **kwargs)

    monkeypatch.setattr(SyncSession, "check_step", check_step)
    return seen


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


QUIET: dict[str, Any] = {"alerts": False, "system_interval": None, "report": False}


@pytest.mark.parametrize(("accumulate", "expected"), [(1, [4, 4, 2]), (2, [8, 2])])
def test_lightning(
    tmp_path: Path, told: list[int | None], accumulate: int, expected: list[int]
) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from eventbus_debug.integrations.lightning import EventBusDebugCallback

    class Module(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    from ._lightning import quiet_trainer

    torch.manual_seed(0)
    trainer = quiet_trainer(
        [EventBusDebugCallback(log_dir=tmp_path, **QUIET)], accumulate_grad_batches=accumulate
    )
    trainer.fit(Module(), DataLoader(_data(), batch_size=4))
    assert told == expected


@pytest.mark.parametrize(
    ("accumulate", "expected"),
    [(1, [4, 4, 2]), (2, [8])],  # with 2: the third batch ends the epoch in its window
)
def test_ignite(
    tmp_path: Path, told: list[int | None], accumulate: int, expected: list[int]
) -> None:
    pytest.importorskip("ignite")
    from ignite.engine import create_supervised_trainer

    from eventbus_debug.integrations.ignite import EventBusDebugHandler

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    handler = EventBusDebugHandler(model, optimizer, log_dir=tmp_path, **QUIET)
    trainer = create_supervised_trainer(
        model, optimizer, nn.MSELoss(), gradient_accumulation_steps=accumulate
    )
    handler.attach(trainer)
    trainer.run(DataLoader(_data(), batch_size=4), max_epochs=1)
    assert told == expected


@pytest.mark.parametrize(("accumulate", "expected"), [(1, [4, 4, 2]), (2, [8, 2])])
def test_transformers(
    tmp_path: Path, told: list[int | None], accumulate: int, expected: list[int]
) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from eventbus_debug.integrations.transformers import EventBusDebugCallback

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": nn.functional.mse_loss(self.net(x), labels)}

    x, y = _data().tensors
    data = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        num_train_epochs=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    debug = EventBusDebugCallback(log_dir=tmp_path / "logs", **QUIET)
    Trainer(model=Regressor(), args=args, train_dataset=data, callbacks=[debug]).train()
    assert told == expected
