"""Seed 001's use case: an async trainer for a sequence model over email-like token sequences.

Each synthetic "email sequence" is a list of token ids (greeting, body topics, call to
action); the model predicts whether the sequence gets a reply. ``results = await
trainer.train()`` runs epochs with the session's probes and recovery built in, evaluates on a
validation split after each epoch, and stops early when validation loss stops improving.

With ``checkpoint=`` the trainer saves a checkpoint after every epoch (the model, the optimizer,
its own progress, the RNG and the debug session's ``state_dict()``) and resumes from it when it
exists: a job that is preempted and started again finishes exactly as the uninterrupted job,
its debug detectors included.

Run: python examples/email_sequence_optimizer.py
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch
from torch import nn

from eventbus_debug import DebugMode, Session

VOCAB = 64
SEQ_LEN = 12
REPLY_TOKENS = (5, 9, 17)  # "meeting", "question", "pricing": emails with them get replies


def email_dataset(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """*n* token sequences and reply labels (1 when a reply-provoking token is present)."""
    tokens = torch.randint(20, VOCAB, (n, SEQ_LEN), generator=gen)
    tokens[:, 0] = 1  # greeting
    has = torch.rand(n, generator=gen) < 0.4
    pos = torch.randint(1, SEQ_LEN, (n,), generator=gen)
    which = torch.tensor(REPLY_TOKENS)[torch.randint(0, len(REPLY_TOKENS), (n,), generator=gen)]
    tokens[has, pos[has]] = which[has]
    return tokens, has.float().unsqueeze(1)


class SequenceModel(nn.Module):
    """Embedding, a GRU, and a linear head on the last hidden state."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, h = self.rnn(self.embed(tokens))
        return self.head(h[-1])


@dataclass
class TrainingResults:
    """What :meth:`EmailSequenceTrainer.train` returns."""

    epochs_run: int
    best_val_loss: float
    val_accuracy: float
    stopped_early: bool
    history: list[float] = field(default_factory=list)


class EmailSequenceTrainer:
    """An async trainer with debugging built in (the seed's enhanced training optimizer)."""

    def __init__(
        self,
        *,
        max_epochs: int = 30,
        batch_size: int = 64,
        train_size: int = 2048,
        patience: int = 3,
        log_dir: str | None = "debug_logs/email",
        debug_mode: DebugMode = DebugMode.ANOMALY_DETECTION,
        checkpoint: str | None = None,
    ) -> None:
        gen = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        self.train_x, self.train_y = email_dataset(train_size, gen)
        self.val_x, self.val_y = email_dataset(max(64, train_size // 4), gen)
        self.model = SequenceModel()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=3e-3)
        self.max_epochs = max_epochs
        self.batch_size = batch_size
        self.patience = patience
        self.log_dir = log_dir
        self.debug_mode = debug_mode
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None

    def _save(self, session: Session, progress: dict[str, Any]) -> None:
        """Everything the next job needs to go on where this one is, written atomically."""
        assert self.checkpoint is not None
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "progress": progress,
            "debug": session.state_dict(),  # what the detectors learned of the run
        }
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        partial = self.checkpoint.with_name(self.checkpoint.name + ".partial")
        torch.save(state, partial)
        os.replace(partial, self.checkpoint)

    def _resume(self, session: Session) -> dict[str, Any] | None:
        """Load the checkpoint, if there is one, into the model, optimizer, RNG and session."""
        if self.checkpoint is None or not self.checkpoint.exists():
            return None
        state = torch.load(self.checkpoint, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        session.load_state_dict(state["debug"])  # before the session starts
        progress: dict[str, Any] = state["progress"]
        return progress

    def _validate(self) -> tuple[float, float]:
        self.model.eval()
        with torch.no_grad():
            logits = self.model(self.val_x)
            loss = float(self.loss_fn(logits, self.val_y))
            acc = float(((logits > 0).float() == self.val_y).float().mean())
        self.model.train()
        return loss, acc

    async def train(self) -> TrainingResults:
        """Train until *max_epochs* or until validation loss stalls for *patience* epochs."""
        best, best_acc, bad_epochs, step, done = math.inf, 0.0, 0, 0, 0
        history: list[float] = []
        stopped = False
        session = Session(
            self.model, self.optimizer, log_dir=self.log_dir, mode=self.debug_mode, name="email"
        )
        progress = self._resume(session)
        if progress is not None:
            best, best_acc = progress["best"], progress["best_acc"]
            bad_epochs, step, done = progress["bad_epochs"], progress["step"], progress["epochs"]
            history, stopped = list(progress["history"]), progress["stopped"]
        epochs_run = done
        async with session:
            for epoch in range(done + 1, self.max_epochs + 1):
                if stopped:
                    break
                epochs_run = epoch
                order = torch.randperm(len(self.train_x))
                for i in range(0, len(order), self.batch_size):
                    idx = order[i : i + self.batch_size]
                    await session.training_step(
                        self.train_x[idx], self.train_y[idx], self.loss_fn, step=step
                    )
                    step += 1
                with session.debug_context("validation"):
                    val_loss, val_acc = self._validate()
                history.append(val_loss)
                if val_loss < best - 1e-4:
                    best, best_acc, bad_epochs = val_loss, val_acc, 0
                else:
                    bad_epochs += 1
                    stopped = bad_epochs >= self.patience
                if self.checkpoint is not None:
                    self._save(
                        session,
                        {
                            "epochs": epoch,
                            "step": step,
                            "best": best,
                            "best_acc": best_acc,
                            "bad_epochs": bad_epochs,
                            "history": history,
                            "stopped": stopped,
                        },
                    )
        return TrainingResults(
            epochs_run=epochs_run,
            best_val_loss=best,
            val_accuracy=best_acc,
            stopped_early=stopped,
            history=history,
        )


async def main(
    max_epochs: int = 30,
    train_size: int = 2048,
    log_dir: str | None = "debug_logs/email",
    checkpoint: str | None = "checkpoints/email.pt",
) -> TrainingResults:
    trainer = EmailSequenceTrainer(
        max_epochs=max_epochs, train_size=train_size, log_dir=log_dir, checkpoint=checkpoint
    )
    if checkpoint is not None and Path(checkpoint).exists():
        print(f"resuming from {checkpoint}")
    results = await trainer.train()
    print(
        f"{results.epochs_run} epochs, best validation loss {results.best_val_loss:.4f}, "
        f"accuracy {results.val_accuracy:.1%}, stopped early: {results.stopped_early}"
    )
    if log_dir is not None:
        print(f"report: {Path(log_dir, 'report.html').resolve()}")
    return results


if __name__ == "__main__":
    anyio.run(main)
