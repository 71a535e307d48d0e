"""Every example runs at its default size (what a user runs), so none can rot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def test_every_example_is_tested() -> None:
    """Each file in examples/ has a test here."""
    tested = {
        "sync_training_loop",
        "custom_sink",
        "alert_handlers",
        "error_recovery",
        "security_input_validation",
        "ads_diffusion_debugging",
        "email_sequence_optimizer",
        "ddp_training",  # run under torchrun by tests/sinks/report/test_aggregate.py
    }
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


def test_sync_training_loop(tmp_path: Path) -> None:
    """The plain loop logs every step and skips the NaN one."""
    out = _load("sync_training_loop").main(log_dir=str(tmp_path / "logs"))
    assert out["skipped"] == 1 and out["events"] > 600


async def test_custom_sink() -> None:
    """The custom sink sees every step and is closed."""
    average = await _load("custom_sink").main()
    assert 0 < average < 10


async def test_alert_handlers() -> None:
    """Both handlers fire: NaN pages, explosion notes."""
    received = await _load("alert_handlers").main()
    assert any(r.startswith("page:") for r in received)
    assert any(r.startswith("note:") for r in received)


async def test_error_recovery() -> None:
    """OOM shrinks the batch, timeouts are retried, the corrupt batch's step is skipped."""
    counts = await _load("error_recovery").main()
    assert counts["batch_size"] == 32 and counts["shrink_batch"] >= 1
    assert counts["retries"] >= 2 and counts["skipped_steps"] >= 1


async def test_security_input_validation() -> None:
    """Both corrupt batches are rejected; the dead model's outputs are reported as collapsed."""
    out = await _load("security_input_validation").main()
    assert out["rejected"] == 2 and out["validation_incidents"] == 2
    assert out["output_anomalies"] >= 1


async def test_ads_diffusion_debugging() -> None:
    """The broken sample's latent drift is reported as an incident."""
    out = await _load("ads_diffusion_debugging").main()
    assert out["components"] == 2 and out["incidents"] >= 1


async def test_email_sequence_optimizer(tmp_path: Path) -> None:
    """results = await trainer.train() at the default size returns validated results, stops
    early, writes the report and a checkpoint; run again, it resumes from it and is done."""
    example = _load("email_sequence_optimizer")
    results = await example.main()
    assert results.stopped_early and results.val_accuracy > 0.9
    assert len(results.history) == results.epochs_run
    assert (tmp_path / "debug_logs" / "email" / "report.html").exists()
    again = await example.main()  # the checkpoint says it finished
    assert again == results


async def test_email_sequence_optimizer_resumes_as_if_never_stopped(tmp_path: Path) -> None:
    """A job stopped after 3 epochs and started again finishes as the uninterrupted job: the
    same validation history, and the same debug detector state in its last checkpoint."""
    example = _load("email_sequence_optimizer")
    full = await example.main(8, 512, str(tmp_path / "a"), str(tmp_path / "a.pt"))
    first = await example.main(3, 512, str(tmp_path / "b"), str(tmp_path / "b.pt"))
    assert first.epochs_run == 3
    resumed = await example.main(8, 512, str(tmp_path / "b"), str(tmp_path / "b.pt"))
    assert resumed == full
    debug = [torch.load(tmp_path / f"{run}.pt", weights_only=True)["debug"] for run in ("a", "b")]
    assert debug[0]["probe"] == debug[1]["probe"] and debug[0]["step"] == debug[1]["step"]
