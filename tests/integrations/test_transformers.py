"""Hugging Face Trainer: the callback sees unclipped gradients, clips itself, skips NaN steps."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from eventbus_debug import SyncSession, TrainingStopped, read_events
from eventbus_debug.events import (
    GradientExploded,
    NonFiniteDetected,
    SessionEnded,
    StepCompleted,
    StepSkipped,
)
from eventbus_debug.integrations.transformers import EventBusDebugCallback

STEPS = 8
MAX_GRAD_NORM = 1.0


def _model(**config: Any) -> BertForSequenceClassification:
    """A tiny BERT classifier (no download); *config* overrides ``BertConfig``'s fields."""
    small = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 100,
        "max_position_embeddings": 32,
    }
    return BertForSequenceClassification(BertConfig(**(small | config)))


def _data(n: int = STEPS * 4) -> list[dict[str, torch.Tensor]]:
    return [
        {
            "input_ids": torch.randint(1, 100, (12,)),
            "attention_mask": torch.ones(12, dtype=torch.long),
            "labels": torch.tensor(i % 2),
        }
        for i in range(n)
    ]


def _plant_faults(model: nn.Module, *, nan_at: int, explode_at: int) -> None:
    """Multiply the loss of the given training forward passes by NaN / 1e9."""
    calls = [0]

    def hook(module: nn.Module, inputs: Any, output: Any) -> Any:
        if not module.training:
            return None
        n = calls[0]
        calls[0] += 1
        if n == nan_at:
            output["loss"] = output["loss"] * math.nan
        elif n == explode_at:
            output["loss"] = output["loss"] * 1e9
        return output

    model.register_forward_hook(hook)


class Watch(TrainerCallback):
    """Per step: did the parameters change, the gradient norm the optimizer got, the session."""

    def __init__(self, debug: EventBusDebugCallback) -> None:
        self.debug = debug
        self.changed: list[bool] = []
        self.applied_norms: list[float] = []
        self.schedulers: tuple[Any, ...] = ()
        self.max_grad_norm_during: float | None = None
        self._before: list[torch.Tensor] = []

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        assert self.debug.session is not None
        self.schedulers = self.debug.session.schedulers
        self.max_grad_norm_during = args.max_grad_norm

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._before = [p.detach().clone() for p in kw["model"].parameters()]

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        grads = [p.grad for p in kw["model"].parameters() if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if grads
            else 0.0
        )
        self.applied_norms.append(norm)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        after = list(kw["model"].parameters())
        self.changed.append(
            any(not torch.equal(a, b) for a, b in zip(self._before, after, strict=True))
        )


def _trainer(
    tmp_path: Path, model: nn.Module, callbacks: list[TrainerCallback], **options: Any
) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_grad_norm=MAX_GRAD_NORM,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **options,
    )
    return Trainer(model=model, args=args, train_dataset=_data(), callbacks=callbacks)


def test_nan_skipped_explosion_seen_unclipped_and_clipping_kept(tmp_path: Path) -> None:
    """A NaN step leaves the weights alone; a 1e9 loss shows its real norm; clipping still holds."""
    model = _model()
    _plant_faults(model, nan_at=3, explode_at=6)
    debug = EventBusDebugCallback(log_dir=tmp_path / "logs", alerts=False, system_interval=None)
    watch = Watch(debug)
    trainer = _trainer(tmp_path, model, [debug, watch])
    trainer.train()

    assert watch.changed == [i != 3 for i in range(STEPS)]
    assert trainer.state.global_step == STEPS
    assert debug.steps_checked == STEPS and debug.steps_skipped == 1
    # Trainer does not clip while the callback runs (it clips to the same max_grad_norm
    # itself), yet the arguments read the user's value all along
    assert watch.max_grad_norm_during == MAX_GRAD_NORM
    assert trainer.args.max_grad_norm == MAX_GRAD_NORM
    assert all(n <= MAX_GRAD_NORM * (1 + 1e-4) for n in watch.applied_norms)
    events = list(read_events(tmp_path / "logs"))
    assert {e.step for e in events if isinstance(e, NonFiniteDetected)} == {3}
    assert [e.step for e in events if isinstance(e, StepSkipped)] == [3]
    exploded = [e for e in events if isinstance(e, GradientExploded)]
    assert [e.step for e in exploded] == [6] and exploded[0].total_norm > 1e6
    completed = [e for e in events if isinstance(e, StepCompleted)]
    assert [e.step for e in completed] == list(range(STEPS))
    assert completed[0].loss is not None and 0.1 < completed[0].loss < 10  # outputs.loss, unscaled
    assert isinstance(events[-1], SessionEnded) and events[-1].reason == "completed"
    # HF still logs the pre-clip norm it measured: the explosion is there too
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(logged) == STEPS and logged[6] > 1e6
    assert watch.schedulers == (trainer.lr_scheduler,)


def test_gradient_accumulation_checks_each_optimizer_step_once(tmp_path: Path) -> None:
    """With gradient_accumulation_steps=2 each optimizer step is checked once."""
    debug = EventBusDebugCallback(log_dir=tmp_path / "logs", alerts=False, system_interval=None)
    trainer = _trainer(tmp_path, _model(), [debug], gradient_accumulation_steps=2)
    trainer.train()
    assert debug.steps_checked == STEPS and debug.steps_skipped == 0
    completed = [e for e in read_events(tmp_path / "logs") if isinstance(e, StepCompleted)]
    assert [e.step for e in completed] == list(range(STEPS))


def test_training_stopped_gives_max_grad_norm_back_and_next_train_starts_fresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop raised at the safe point ends the session and restores the arguments."""
    original = SyncSession.check_step

    def stop_at_two(self: SyncSession, step: int, **kwargs: Any) -> Any:
        if step == 2:
            raise TrainingStopped("planted stop")
        return original(self, step, **kwargs)

    debug = EventBusDebugCallback(log_dir=tmp_path / "logs", alerts=False, system_interval=None)
    trainer = _trainer(tmp_path, _model(), [debug])
    with monkeypatch.context() as patch:
        patch.setattr(SyncSession, "check_step", stop_at_two)
        with pytest.raises(TrainingStopped, match="planted stop"):
            trainer.train()
    assert trainer.args.max_grad_norm == MAX_GRAD_NORM and debug.session is None
    trainer.train()  # a fresh run: its own session, the loss hook registered once again
    assert debug.steps_checked == STEPS
    ended = [e.reason for e in read_events(tmp_path / "logs") if isinstance(e, SessionEnded)]
    assert ended == ["stopped", "completed"]


def test_deepspeed_or_fsdp_is_refused_clearly() -> None:
    """Sharded clipping inside DeepSpeed/FSDP cannot be checked: a clear ValueError."""
    debug = EventBusDebugCallback(log_dir=None)
    args = cast(
        TrainingArguments, SimpleNamespace(deepspeed=None, fsdp="full_shard", max_grad_norm=1.0)
    )
    with pytest.raises(ValueError, match="FSDP"):
        debug.on_train_begin(args, TrainerState(), TrainerControl(), model=nn.Linear(1, 1))


def test_missing_model_or_optimizer_is_refused_clearly() -> None:
    """on_train_begin without the Trainer's model/optimizer raises naming them."""
    debug = EventBusDebugCallback(log_dir=None)
    args = cast(TrainingArguments, SimpleNamespace(deepspeed=None, fsdp=None, max_grad_norm=1.0))
    with pytest.raises(ValueError, match="model and optimizer"):
        debug.on_train_begin(args, TrainerState(), TrainerControl(), model=nn.Linear(1, 1))
    assert debug.session is None


def test_log_dir_as_session_option_is_rejected() -> None:
    """log_dir is the callback's own argument; as a session option it is a TypeError."""
    with pytest.raises(TypeError, match="log_dir"):
        EventBusDebugCallback(**{"log_dir": None, "optimizer": None})


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32)
    return GPT2LMHeadModel(config)


def _lm_data(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 100, (12,), generator=gen)
        labels = ids.clone()
        labels[: int(torch.randint(0, 6, (), generator=gen))] = -100  # uneven token counts
        out.append(
            {"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long), "labels": labels}
        )
    return out


@pytest.mark.parametrize("accumulation", [1, 4])
def test_a_token_normalized_loss_is_the_step_loss_trainer_logs(
    tmp_path: Path, accumulation: int
) -> None:
    """GPT-2 takes ``num_items_in_batch``: each micro-batch's loss is divided by the step's
    token count, so the step's loss is their sum; it matches Trainer's logged loss whatever
    the accumulation (the mean would read 1/accumulation of it)."""
    debug = EventBusDebugCallback(log_dir=tmp_path / "logs", alerts=False, system_interval=None)
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=_gpt2(), args=args, train_dataset=_lm_data(32), callbacks=[debug])
    assert trainer.model_accepts_loss_kwargs
    trainer.train()
    completed = [e for e in read_events(tmp_path / "logs") if isinstance(e, StepCompleted)]
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(completed) == len(logged) == 4
    for event, loss in zip(completed, logged, strict=True):
        assert event.loss is not None
        assert event.loss == pytest.approx(loss, rel=1e-3, abs=1e-3)
        assert 3.0 < event.loss < 6.0  # about log(100): an untrained 100-token vocabulary


def test_a_transformers_before_5_3_is_told_it_logs_no_grad_norm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trainer before 5.3 measures no grad_norm when it does not clip (it has no
    ``_get_grad_norm``): the callback says so once, and training runs on."""

    class Unhide(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.trainer.hide = False  # after the debug callback's look

    class Before53(Trainer):
        hide = True

        def __getattribute__(self, name: str) -> Any:
            if name == "_get_grad_norm" and object.__getattribute__(self, "hide"):
                raise AttributeError(name)
            return super().__getattribute__(name)

    debug = EventBusDebugCallback(log_dir=None, alerts=False, system_interval=None)
    unhide = Unhide()
    args = _trainer(tmp_path, _model(), []).args
    trainer = Before53(model=_model(), args=args, train_dataset=_data(), callbacks=[debug, unhide])
    unhide.trainer = trainer
    with caplog.at_level("WARNING", logger="eventbus_debug"):
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if "logs no grad_norm" in r.getMessage()]
    assert len(warned) == 1 and "transformers>=5.3" in warned[0]
    assert debug.steps_checked == STEPS


def test_a_current_transformers_is_not_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    debug = EventBusDebugCallback(log_dir=None, alerts=False, system_interval=None)
    with caplog.at_level("WARNING", logger="eventbus_debug"):
        _trainer(tmp_path, _model(), [debug]).train()
    assert not [r for r in caplog.records if "logs no grad_norm" in r.getMessage()]
