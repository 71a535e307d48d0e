"""A Lightning ``Trainer`` for the tests: CPU, one device, one epoch, nothing written or shown
but what a test asks for."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl


def quiet_trainer(callbacks: Sequence[pl.Callback], **options: Any) -> pl.Trainer:
    """A ``pl.Trainer`` with *callbacks*: no logger, checkpoints, progress bar or model
    summary; *options* override or add ``Trainer`` arguments."""
    settings: dict[str, Any] = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    settings.update(options)
    return pl.Trainer(callbacks=list(callbacks), **settings)
