"""Seed 001's use case: an async trainer for a sequence model over email-like token sequences.

Each synthetic "email sequence" is a list of token ids (greeting, body topics, call to
action); the model predicts whether the sequence gets a reply. ``results = await
trainer.train()`` runs epochs with the session's probes and recovery built in, evaluates on a
validation split after each epoch, and stops early when validation loss stops improving.

Run: python examples/email_sequence_optimizer.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

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
        best, best_acc, bad_epochs, step = math.inf, 0.0, 0, 0
        history: list[float] = []
        stopped = False
        async with Session(
            self.model, self.optimizer, log_dir=self.log_dir, mode=self.debug_mode, name="email"
        ) as session:
            epochs_run = 0
            for epoch in range(1, self.max_epochs + 1):
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
                    if bad_epochs >= self.patience:
                        stopped = True
                        break
        return TrainingResults(
            epochs_run=epochs_run,
            best_val_loss=best,
            val_accuracy=best_acc,
            stopped_early=stopped,
            history=history,
        )


async def main(
    max_epochs: int = 30, train_size: int = 2048, log_dir: str | None = "debug_logs/email"
) -> TrainingResults:
    trainer = EmailSequenceTrainer(max_epochs=max_epochs, train_size=train_size, log_dir=log_dir)
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
