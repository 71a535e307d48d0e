"""Resuming from a framework's own checkpoint carries the debug session's state.

For each framework: a run is checkpointed mid-way by the framework's own mechanism (Lightning's
``ModelCheckpoint``, Hugging Face ``save_strategy="steps"``, Ignite's ``Checkpoint``), a fresh
trainer resumes from that checkpoint, and its session ends with exactly the state of the run
that never stopped (the spike detector's ``judged`` count goes on from the checkpoint rather
than restarting at 0). Then the failure paths: a checkpoint without the state, a malformed
state, a state loaded into a session that has ended.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from ignite.engine import Engine, Events, create_supervised_trainer
from ignite.handlers import Checkpoint, DiskSaver
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertForSequenceClassification, Trainer, TrainingArguments

from eventbus_debug import SyncSession
from eventbus_debug.integrations.ignite import EventBusDebugHandler
from eventbus_debug.integrations.lightning import EventBusDebugCallback as LightningCallback
from eventbus_debug.integrations.transformers import STATE_FILE, EventBusDebugCallback as HFCallback

from ._lightning import quiet_trainer
from .test_transformers import _model as bert

QUIET: dict[str, Any] = {"log_dir": None, "alerts": False, "system_interval": None}
BATCHES = 8  # per epoch, every framework
EPOCHS = 4
RESUME_EPOCH = 2  # the checkpoint resumed from: after this many epochs


def _judged(state: dict[str, Any]) -> int:
    """How many losses the spike detector has judged, in a session's state dict."""
    probe = state["probe"]
    return 0 if probe is None else int(probe["judge"]["spikes"]["judged"])


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(BATCHES * 8, 4)
    return x, x.sum(1, keepdim=True) + 0.1 * torch.randn(BATCHES * 8, 1)


# -- Lightning ----------------------------------------------------------------------------------


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


ENTRY = "EventBusDebugCallback"  # the callback's state_key: its entry in checkpoint["callbacks"]


def _entry(ckpt: Path) -> dict[str, Any]:
    """The callback's entry in a Lightning checkpoint (loaded as Lightning loads it)."""
    return dict(torch.load(ckpt, weights_only=True)["callbacks"][ENTRY])


class SeenAtStart(pl.Callback):
    """The session, and its state, when the fit's training starts (after any restore)."""

    def __init__(self) -> None:
        self.session: SyncSession | None = None
        self.state: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        debug = next(c for c in trainer.callbacks if isinstance(c, LightningCallback))  # type: ignore[attr-defined]
        self.session = debug.session
        assert self.session is not None
        self.state = self.session.state_dict()


def _lightning_fit(
    debug: LightningCallback, tmp_path: Path, *, ckpt_path: Path | None = None
) -> tuple[pl.Trainer, SeenAtStart]:
    """Fit 4 epochs, a checkpoint at the end of each in ``tmp_path / "ckpt"`` (a fit resumed
    from a checkpoint must save to the folder the checkpoint names, empty: Lightning warns
    otherwise)."""
    seen = SeenAtStart()
    saver = ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        filename="{epoch}",
        save_top_k=-1,
        every_n_epochs=1,
        save_on_train_epoch_end=True,
    )
    trainer = quiet_trainer([debug, seen, saver], max_epochs=EPOCHS, enable_checkpointing=True)
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    trainer.fit(Regression(), loader, ckpt_path=ckpt_path)
    return trainer, seen


def _uninterrupted(tmp_path: Path) -> Path:
    """Fit without a stop; its checkpoints moved to ``saved`` (the resumed fit writes its own
    to ``ckpt``). The folder is returned."""
    _lightning_fit(LightningCallback(**QUIET), tmp_path)
    return (tmp_path / "ckpt").rename(tmp_path / "saved")


def test_lightning_resume_from_ckpt_continues_the_detectors(tmp_path: Path) -> None:
    """Every ``.ckpt`` holds the session's state; ``trainer.fit(ckpt_path=...)`` restores it
    (before ``on_fit_start``), and the resumed fit's last checkpoint holds exactly the
    uninterrupted fit's."""
    saved = _uninterrupted(tmp_path)
    expected = _entry(saved / f"epoch={EPOCHS - 1}.ckpt")
    assert expected["format"] == "eventbus_debug.Session"
    assert _judged(expected) == EPOCHS * BATCHES
    ckpt = saved / f"epoch={RESUME_EPOCH - 1}.ckpt"
    assert _judged(_entry(ckpt)) == RESUME_EPOCH * BATCHES

    resumed = LightningCallback(**QUIET)
    _, seen = _lightning_fit(resumed, tmp_path, ckpt_path=ckpt)
    assert seen.state is not None and _judged(seen.state) == RESUME_EPOCH * BATCHES
    assert resumed.steps_checked == (EPOCHS - RESUME_EPOCH) * BATCHES
    assert _entry(tmp_path / "ckpt" / f"epoch={EPOCHS - 1}.ckpt") == expected


def test_lightning_without_our_state_starts_afresh(tmp_path: Path) -> None:
    """A checkpoint saved without the callback resumes; the detectors count from zero."""
    checkpoint = torch.load(
        _uninterrupted(tmp_path) / f"epoch={RESUME_EPOCH - 1}.ckpt", weights_only=True
    )
    del checkpoint["callbacks"][ENTRY]
    bare = tmp_path / "bare.ckpt"
    torch.save(checkpoint, bare)

    _, seen = _lightning_fit(LightningCallback(**QUIET), tmp_path, ckpt_path=bare)
    assert seen.state is not None and _judged(seen.state) == 0
    last = _entry(tmp_path / "ckpt" / f"epoch={EPOCHS - 1}.ckpt")
    assert _judged(last) == (EPOCHS - RESUME_EPOCH) * BATCHES


def test_lightning_malformed_state_in_the_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    """A ``.ckpt`` whose entry is not a session's state: the fit fails naming the field."""
    checkpoint = torch.load(
        _uninterrupted(tmp_path) / f"epoch={RESUME_EPOCH - 1}.ckpt", weights_only=True
    )
    checkpoint["callbacks"][ENTRY]["version"] = "one"
    broken = tmp_path / "broken.ckpt"
    torch.save(checkpoint, broken)
    debug = LightningCallback(**QUIET)
    with pytest.raises(ValueError, match="version"):
        _lightning_fit(debug, tmp_path, ckpt_path=broken)
    assert debug.session is None and debug.steps_checked == 0


def test_lightning_state_between_fits_and_an_ended_session(tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` after the fit saves the last fit's state; a state loaded
    between fits is checked at once and carried into the next fit; the ended session itself
    refuses one."""
    debug = LightningCallback(**QUIET)
    trainer, seen = _lightning_fit(debug, tmp_path)
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    last = _entry(tmp_path / "after.ckpt")
    assert last == _entry(tmp_path / "ckpt" / f"epoch={EPOCHS - 1}.ckpt")
    assert _judged(last) == EPOCHS * BATCHES
    assert seen.session is not None
    with pytest.raises(RuntimeError, match="has ended"):
        seen.session.load_state_dict(last)
    with pytest.raises(ValueError, match="format"):
        debug.load_state_dict({"step": 3})

    # loaded after the fit: kept for the next one, which continues from it
    debug.load_state_dict(last)
    _, following = _lightning_fit(debug, tmp_path / "next")
    assert following.state is not None and _judged(following.state) == EPOCHS * BATCHES
    after = _entry(tmp_path / "next" / "ckpt" / f"epoch={EPOCHS - 1}.ckpt")
    assert _judged(after) == 2 * EPOCHS * BATCHES


# -- Hugging Face -------------------------------------------------------------------------------


def _bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _hf_data() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(1, 100, (12,), generator=generator),
            "attention_mask": torch.ones(12, dtype=torch.long),
            "labels": torch.tensor(i % 2),
        }
        for i in range(BATCHES * 4)
    ]


def _hf_train(
    debug: HFCallback, output_dir: Path, *, resume: Path | None = None, max_steps: int = 16
) -> Trainer:
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        use_cpu=True,
        report_to=[],
        save_strategy="steps",
        save_steps=BATCHES,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=_bert(), args=args, train_dataset=_hf_data(), callbacks=[debug])
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    return trainer


def test_hf_resume_from_checkpoint_continues_the_detectors(tmp_path: Path) -> None:
    """``on_save`` writes the state into each checkpoint folder; ``train(resume_from_checkpoint=)``
    reads it back: the resumed run ends with exactly the uninterrupted run's state."""
    full = HFCallback(**QUIET)
    _hf_train(full, tmp_path / "full")
    expected = full.state_dict()
    assert _judged(expected) == 2 * BATCHES
    checkpoint = tmp_path / "full" / f"checkpoint-{BATCHES}"
    saved = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))
    assert _judged(saved) == BATCHES and saved["step"] == BATCHES - 1
    assert json.loads((tmp_path / "full" / "checkpoint-16" / STATE_FILE).read_text()) == expected

    # resumed into another output_dir: the state comes from the checkpoint resumed from
    resumed = HFCallback(**QUIET)
    _hf_train(resumed, tmp_path / "resumed", resume=checkpoint)
    assert resumed.steps_checked == BATCHES
    assert resumed.state_dict() == expected


def test_hf_checkpoint_without_the_state_file_warns_and_trains_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint without (or with an unreadable) state file: one warning, the run goes on,
    the detectors start afresh."""
    _hf_train(HFCallback(**QUIET), tmp_path / "full", max_steps=BATCHES)
    checkpoint = tmp_path / "full" / f"checkpoint-{BATCHES}"
    (checkpoint / STATE_FILE).unlink()
    cold = HFCallback(**QUIET)
    with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
        _hf_train(cold, tmp_path / "cold", resume=checkpoint)
    warned = [r.getMessage() for r in caplog.records if STATE_FILE in r.getMessage()]
    assert len(warned) == 1 and "start afresh" in warned[0], warned
    assert cold.steps_checked == BATCHES
    assert _judged(cold.state_dict()) == BATCHES

    caplog.clear()
    (checkpoint / STATE_FILE).write_text('{"format": "eventbus_debug.Session"}', encoding="utf-8")
    broken = HFCallback(**QUIET)
    with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
        _hf_train(broken, tmp_path / "broken", resume=checkpoint)
    warned = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(warned) == 1 and "version" in warned[0], warned
    assert _judged(broken.state_dict()) == BATCHES


def test_hf_explicit_state_and_its_errors(tmp_path: Path) -> None:
    """``load_state_dict`` by hand: a malformed state is a ValueError at once; a good one wins
    over the checkpoint's file; the ended session refuses one."""
    first = HFCallback(**QUIET)
    _hf_train(first, tmp_path / "first", max_steps=BATCHES)
    state = first.state_dict()
    assert _judged(state) == BATCHES

    debug = HFCallback(**QUIET)
    empty = SyncSession(nn.Linear(2, 1), None, **QUIET).state_dict()  # a session not started
    assert empty["format"] == "eventbus_debug.Session" and empty["probe"] is None
    assert debug.state_dict() == empty  # nothing learned, nothing loaded
    with pytest.raises(ValueError, match="format"):
        debug.load_state_dict({"probe": None})
    assert debug.state_dict() == empty  # nothing changed
    debug.load_state_dict(state)
    assert debug.state_dict() == state
    assert json.loads(json.dumps(state)) == state
    _hf_train(debug, tmp_path / "second", max_steps=BATCHES)  # not a resume: the state is used
    assert _judged(debug.state_dict()) == 2 * BATCHES

    session = SyncSession(nn.Linear(2, 1), None, **QUIET)
    with session:
        pass
    with pytest.raises(RuntimeError, match="has ended"):
        session.load_state_dict(state)


# -- Ignite -------------------------------------------------------------------------------------


def _ignite_run(
    tmp_path: Path, *, load: Path | None = None, debug_state: bool = True
) -> tuple[EventBusDebugHandler, Engine]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    handler = EventBusDebugHandler(model, optimizer, **QUIET)
    trainer = create_supervised_trainer(model, optimizer, handler.track_loss(nn.MSELoss()))
    handler.attach(trainer)
    to_save: dict[str, Any] = {"model": model, "optimizer": optimizer, "trainer": trainer}
    if debug_state:
        to_save["debug"] = handler
    saver = Checkpoint(to_save, DiskSaver(str(tmp_path), require_empty=False), n_saved=None)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, saver)
    if load is not None:
        Checkpoint.load_objects(to_load=to_save, checkpoint=load)
    x, y = _data()
    trainer.run([(x[i : i + 8], y[i : i + 8]) for i in range(0, len(x), 8)], max_epochs=EPOCHS)
    return handler, trainer


def test_ignite_checkpoint_to_save_carries_the_state(tmp_path: Path) -> None:
    """The handler in ``Checkpoint(to_save=...)``; ``Checkpoint.load_objects`` before the run:
    the resumed run ends with exactly the uninterrupted run's state."""
    full, _ = _ignite_run(tmp_path / "full")
    expected = full.state_dict()
    assert _judged(expected) == EPOCHS * BATCHES
    checkpoint = tmp_path / "full" / f"checkpoint_{RESUME_EPOCH * BATCHES}.pt"
    saved = torch.load(checkpoint, weights_only=True)["debug"]
    assert _judged(saved) == RESUME_EPOCH * BATCHES

    resumed, engine = _ignite_run(tmp_path / "resumed", load=checkpoint)
    assert engine.state.iteration == EPOCHS * BATCHES
    assert resumed.steps_checked == (EPOCHS - RESUME_EPOCH) * BATCHES
    assert resumed.state_dict() == expected


def test_ignite_failure_paths_and_a_state_loaded_mid_run(tmp_path: Path) -> None:
    """Without the handler in the checkpoint the detectors start afresh; a malformed state is
    a ValueError from ``load_objects``; a state loaded between steps goes into the running
    session; the ended session refuses one."""
    full, _ = _ignite_run(tmp_path / "full")
    state = full.state_dict()
    checkpoint = tmp_path / "full" / f"checkpoint_{RESUME_EPOCH * BATCHES}.pt"

    cold, _ = _ignite_run(tmp_path / "cold", load=checkpoint, debug_state=False)
    assert _judged(cold.state_dict()) == (EPOCHS - RESUME_EPOCH) * BATCHES

    model = nn.Linear(4, 1)
    handler = EventBusDebugHandler(model, torch.optim.SGD(model.parameters(), lr=0.1), **QUIET)
    with pytest.raises(ValueError, match="format"):
        Checkpoint.load_objects(to_load={"debug": handler}, checkpoint={"debug": {"step": 1}})
    assert handler.state_dict()["probe"] is None

    handler.attach(engine := Engine(lambda engine, batch: _sgd_step(model, handler, batch)))
    sessions: list[SyncSession] = []

    @engine.on(Events.ITERATION_COMPLETED(once=3))
    def load_between_steps(_: Engine) -> None:
        assert handler.session is not None
        sessions.append(handler.session)
        handler.load_state_dict(state)

    x, y = _data()
    engine.run([(x[i : i + 8], y[i : i + 8]) for i in range(0, len(x), 8)], max_epochs=1)
    assert _judged(handler.state_dict()) == _judged(state) + BATCHES - 3
    with pytest.raises(RuntimeError, match="has ended"):
        sessions[0].load_state_dict(state)


def _sgd_step(model: nn.Module, handler: EventBusDebugHandler, batch: Any) -> float:
    x, y = batch
    optimizer = handler.optimizer
    optimizer.zero_grad()
    loss = handler.track_loss(nn.functional.mse_loss)(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return float(loss.detach())
