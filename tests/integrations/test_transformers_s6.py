"""Hugging Face Trainer: the callback's clip is Trainer's own (bit for bit), the arguments are
never left changed, a train() that raised has its session closed, and the step's loss is the
one Trainer computes and logs (label smoothing included) with its samples."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn
from transformers import (
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from eventbus_debug import read_events
from eventbus_debug.events import SessionEnded, StepChecked, StepCompleted
from eventbus_debug.integrations.transformers import EventBusDebugCallback

from .test_transformers import _model as bert

TINY_NORM = 1e-3  # far below every gradient norm of these runs: every step clips


def _model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return bert(num_labels=3)


def _data(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        {
            "input_ids": torch.randint(1, 100, (12,), generator=gen),
            "attention_mask": torch.ones(12, dtype=torch.long),
            "labels": torch.tensor(int(torch.randint(0, 3, (), generator=gen))),
        }
        for _ in range(n)
    ]


def _args(tmp_path: Path, **options: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "hf"),
        "max_steps": 8,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "max_grad_norm": 1.0,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 0,
    }
    settings.update(options)
    return TrainingArguments(**settings)


def _callback(tmp_path: Path, name: str = "logs") -> EventBusDebugCallback:
    return EventBusDebugCallback(log_dir=tmp_path / name, alerts=False, system_interval=None)


class AppliedNorms(TrainerCallback):
    """The gradient norm the optimizer gets at each step (after any clipping)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        grads = [p.grad for p in kw["model"].parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_clipped_run_is_bit_for_bit_the_run_without_the_callback(
    tmp_path: Path, accumulation: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Every one of 200 steps clips; the parameters and Trainer's logged losses and norms are
    exactly those of the same seeded run without the callback (dropout on: no RNG used)."""
    steps = 200
    runs = []
    for debug in (False, True):
        model = _model()
        args = _args(
            tmp_path,
            max_steps=steps,
            gradient_accumulation_steps=accumulation,
            max_grad_norm=TINY_NORM,
            output_dir=str(tmp_path / f"hf_{debug}"),
        )
        callbacks: list[TrainerCallback] = [_callback(tmp_path)] if debug else []
        trainer = Trainer(model=model, args=args, train_dataset=_data(800), callbacks=callbacks)
        with caplog.at_level(logging.WARNING, logger="eventbus_debug"):
            trainer.train()
        logged = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
        runs.append((model, logged))
    (plain, plain_logged), (debugged, debugged_logged) = runs
    assert len(plain_logged) == steps and all(norm > TINY_NORM for _, norm in plain_logged)
    assert debugged_logged == plain_logged
    for a, b in zip(plain.parameters(), debugged.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not [r for r in caplog.records if r.name.startswith("eventbus_debug")]
    checked = [e for e in read_events(tmp_path / "logs") if isinstance(e, StepChecked)]
    assert len(checked) == steps  # and the check saw the norms before the clip:
    assert all(e.grad_norm is not None and e.grad_norm > 100 * TINY_NORM for e in checked)


def test_the_arguments_read_the_users_max_grad_norm_during_the_run_and_in_checkpoints(
    tmp_path: Path,
) -> None:
    """Your code, other callbacks and the checkpoints' training_args.bin see max_grad_norm as
    you set it, while the callback clips; afterwards it is a plain float again."""
    seen: list[float] = []

    class Read(TrainerCallback):
        def on_step_end(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
        ) -> None:
            seen.append(args.max_grad_norm)

    applied = AppliedNorms()
    args = _args(tmp_path, save_strategy="steps", save_steps=4, max_grad_norm=0.5)
    trainer = Trainer(
        model=_model(),
        args=args,
        train_dataset=_data(64),
        callbacks=[_callback(tmp_path), Read(), applied],
    )
    trainer.train()
    assert seen == [0.5] * 8
    assert applied.norms and all(n <= 0.5 * (1 + 1e-5) for n in applied.norms)
    saved = sorted((tmp_path / "hf").glob("checkpoint-*/training_args.bin"))
    assert len(saved) == 2
    for path in saved:
        value = torch.load(path, weights_only=False).max_grad_norm
        assert type(value) is float and value == 0.5
    assert type(args.max_grad_norm) is float and args.max_grad_norm == 0.5
    assert "training_step" not in vars(trainer)  # the wrapper is gone with the run


class FailingData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """A dataset whose n-th fetch raises: ``train()`` raises outside any ``training_step``
    (no hook of the callback sees it)."""

    def __init__(self, items: list[dict[str, torch.Tensor]], n: int) -> None:
        self.items = items
        self.n = n
        self.fetches = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.fetches += 1
        if self.fetches == self.n:
            raise RuntimeError("planted data error")
        return self.items[index]


class FailAt:
    """A forward hook raising on the n-th training forward pass (an error inside
    ``training_step``)."""

    def __init__(self, model: nn.Module, n: int) -> None:
        self.calls = 0
        self.n = n
        self.handle = model.register_forward_hook(self)

    def __call__(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if module.training:
            self.calls += 1
            if self.calls == self.n:
                raise RuntimeError("planted data error")


def test_a_train_that_raised_leaves_clipping_to_a_plain_trainer_and_its_session_is_closed(
    tmp_path: Path,
) -> None:
    """After train() raised outside the callback: a Trainer without the callback on the same
    arguments clips; the next train() with a new callback on them closes the old session,
    which then ends with a reason, its steps flushed and its report written."""
    model = _model()
    args = _args(tmp_path, max_grad_norm=TINY_NORM)
    old = _callback(tmp_path, "old")
    failing = FailingData(_data(64), 5 * 4 + 1)  # Trainer fetches a batch ahead: step 4 fails
    first = Trainer(model=model, args=args, train_dataset=failing, callbacks=[old])
    with pytest.raises(RuntimeError, match="planted data error"):
        first.train()
    assert args.max_grad_norm == TINY_NORM and old.session is not None

    applied = AppliedNorms()
    plain = Trainer(model=model, args=args, train_dataset=_data(64), callbacks=[applied])
    plain.train()
    assert len(applied.norms) == 8 and all(n <= TINY_NORM * (1 + 1e-5) for n in applied.norms)

    new = _callback(tmp_path, "new")
    Trainer(model=model, args=args, train_dataset=_data(64), callbacks=[new]).train()
    assert old.session is None and new.session is None
    assert "training_step" not in vars(first)
    events = list(read_events(tmp_path / "old"))
    ended = [e for e in events if isinstance(e, SessionEnded)]
    assert [e.reason for e in ended] == [
        "error: RuntimeError: Trainer.train() ended without on_train_end"
    ]
    assert [e.step for e in events if isinstance(e, StepCompleted)] == [0, 1, 2, 3]
    assert (tmp_path / "old" / "report.json").exists()
    assert type(args.max_grad_norm) is float and args.max_grad_norm == TINY_NORM


def test_an_error_inside_training_step_ends_the_session_with_it(tmp_path: Path) -> None:
    """The wrapped training_step sees the error: the session ends at once with it (log
    flushed, report written, the user's max_grad_norm and the Trainer's method given back),
    not at the next train() as one that "ended without on_train_end"."""
    model = _model()
    FailAt(model, 5)
    args = _args(tmp_path, max_grad_norm=TINY_NORM)
    callback = _callback(tmp_path)
    trainer = Trainer(model=model, args=args, train_dataset=_data(64), callbacks=[callback])
    with pytest.raises(RuntimeError, match="planted data error"):
        trainer.train()
    assert callback.session is None
    assert "training_step" not in vars(trainer)
    assert type(args.max_grad_norm) is float and args.max_grad_norm == TINY_NORM
    events = list(read_events(tmp_path / "logs"))
    ended = [e for e in events if isinstance(e, SessionEnded)]
    assert [e.reason for e in ended] == ["error: RuntimeError: planted data error"]
    assert [e.step for e in events if isinstance(e, StepCompleted)] == [0, 1, 2, 3]
    assert (tmp_path / "logs" / "report.json").exists()


def test_a_session_left_open_is_closed_when_its_callback_is_collected(tmp_path: Path) -> None:
    """The same finalizer closes it at the interpreter's exit, when nothing else did."""
    model = _model()
    callback = _callback(tmp_path)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=FailingData(_data(64), 2 * 4 + 1),
        callbacks=[callback],
    )
    try:
        trainer.train()
    except RuntimeError:
        pass
    assert callback.session is not None
    del trainer, callback
    gc.collect()
    ended = [e for e in read_events(tmp_path / "logs") if isinstance(e, SessionEnded)]
    assert len(ended) == 1 and "without on_train_end" in ended[0].reason


def test_a_callback_listed_twice_is_a_clear_error(tmp_path: Path) -> None:
    """callbacks=[cb, cb] would check and clip every step twice: a ValueError, nothing open."""
    callback = _callback(tmp_path)
    args = _args(tmp_path)
    trainer = Trainer(
        model=_model(), args=args, train_dataset=_data(64), callbacks=[callback, callback]
    )
    with pytest.raises(ValueError, match="2 EventBusDebugCallback"):
        trainer.train()
    assert callback.session is None
    assert type(args.max_grad_norm) is float and args.max_grad_norm == 1.0


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_checked_loss_is_the_loss_trainer_logs_with_label_smoothing_too(
    tmp_path: Path, smoothing: float
) -> None:
    """With label_smoothing_factor Trainer pops the labels and computes the loss itself (the
    model's outputs.loss is None): the step's check still gets the loss Trainer logs."""
    callback = _callback(tmp_path)
    args = _args(tmp_path, label_smoothing_factor=smoothing, gradient_accumulation_steps=2)
    trainer = Trainer(model=_model(), args=args, train_dataset=_data(64), callbacks=[callback])
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    checked = [e.loss for e in read_events(tmp_path / "logs") if isinstance(e, StepChecked)]
    assert len(checked) == len(logged) == 8
    for ours, theirs in zip(checked, logged, strict=True):
        assert ours == pytest.approx(theirs, rel=1e-4)


def test_a_custom_compute_loss_is_checked_and_samples_count_every_micro_batch(
    tmp_path: Path,
) -> None:
    """A Trainer subclass computing its own loss: that loss is checked. Samples are the batch
    sizes of the step's micro-batches, the epoch's short last window included."""

    class Doubled(Trainer):
        def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            return super().compute_loss(model, inputs, *args, **kwargs) * 2

    callback = _callback(tmp_path)
    # 10 batches of 4 a epoch, 4 per step: windows of 4, 4 and 2 batches
    args = _args(tmp_path, gradient_accumulation_steps=4, max_steps=3)
    trainer = Doubled(model=_model(), args=args, train_dataset=_data(40), callbacks=[callback])
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    events = list(read_events(tmp_path / "logs"))
    checked = [e.loss for e in events if isinstance(e, StepChecked)]
    assert checked == pytest.approx(logged, rel=1e-4)
    assert all(loss is not None for loss in checked)
    completed = [e for e in events if isinstance(e, StepCompleted)]
    assert [_samples(e) for e in completed][1:] == [16, 8]  # the first has no duration


def _samples(event: StepCompleted) -> int | None:
    """The samples a StepCompleted stood for (samples_per_s is samples / duration_s)."""
    if event.samples_per_s is None or event.duration_s is None:
        return None
    return round(event.samples_per_s * event.duration_s)


def test_a_training_step_of_the_trainer_object_is_wrapped_then_put_back(tmp_path: Path) -> None:
    """Your own training_step set on the Trainer object is what runs, and what is left after
    the run; an error inside it gives it back at once; a train() that raised elsewhere (the
    data) leaves the wrapper, and the next one replaces it (no nesting)."""
    calls: list[int] = []
    model = _model()
    callback = _callback(tmp_path)
    failing = FailingData(_data(64), 3 * 4 + 1)  # Trainer fetches a batch ahead: step 2 fails
    trainer = Trainer(
        model=model, args=_args(tmp_path), train_dataset=failing, callbacks=[callback]
    )

    def mine(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return Trainer.training_step(trainer, *args, **kwargs)

    trainer.training_step = mine  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="planted"):
        trainer.train()
    left = vars(trainer)["training_step"]
    assert left is not mine and left.__wrapped__ is mine
    failing.n = 0  # healthy from now on
    trainer.train()
    assert vars(trainer)["training_step"] is mine and len(calls) == 2 + 8
    checked = [e for e in read_events(tmp_path / "logs") if isinstance(e, StepChecked)]
    assert len(checked) == 2 + 8 and all(e.loss is not None for e in checked)

    fail = FailAt(model, 3)
    with pytest.raises(RuntimeError, match="planted"):
        trainer.train()
    fail.handle.remove()
    assert vars(trainer)["training_step"] is mine  # given back by the error itself


def test_called_by_something_else_than_a_trainer_it_checks_the_gradients_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Hooks called by another loop (no Trainer above them): a warning says the loss is not
    checked; the gradients are, the clip still applies, the arguments are given back."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    args = cast(TrainingArguments, SimpleNamespace(deepspeed=None, fsdp=None, max_grad_norm=0.5))
    state, control = TrainerState(), TrainerControl()
    callback = _callback(tmp_path)
    with caplog.at_level(logging.WARNING, logger="eventbus_debug.integrations"):
        callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
    assert "loss is not checked" in caplog.text
    assert args.max_grad_norm == 0.5 and args.max_grad_norm > 0  # only a Trainer is told "no"
    model(torch.randn(8, 4)).pow(2).sum().mul(100).backward()
    callback.on_pre_optimizer_step(args, state, control)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert float(torch.nn.utils.get_total_norm(grads)) <= 0.5 * (1 + 1e-5)
    callback.on_step_end(args, state, control)
    callback.on_train_end(args, state, control)
    assert type(args.max_grad_norm) is float and args.max_grad_norm == 0.5
    events = list(read_events(tmp_path / "logs"))
    checked = [e for e in events if isinstance(e, StepChecked)]
    assert len(checked) == 1 and checked[0].loss is None and checked[0].grad_norm is not None
    assert [e.reason for e in events if isinstance(e, SessionEnded)] == ["completed"]
