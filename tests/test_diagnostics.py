"""The library's own diagnostics: stdlib logging under ``eventbus_debug``, silent, never stdout,
never raising into training (DESIGN.md decision 9)."""

from __future__ import annotations

import errno
import io
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from eventbus_debug import read_events
from eventbus_debug.diagnostics import LOGGER_NAME, get_logger
from eventbus_debug.events import SessionEnded, SinkFailed

_TRAIN = """
import sys
import anyio
import torch
from torch import nn
from eventbus_debug import Session

{setup}

async def broken_sink(event):
    raise RuntimeError("this sink always fails")  # the library logs a warning for each

async def main():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    async with Session(model, opt, log_dir=sys.argv[1], sinks=[broken_sink], report=False,
                       system_interval=None) as session:
        for step in range(30):
            opt.zero_grad()
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            if (await session.check_step(step, loss=loss)).should_step:
                opt.step()
            await session.step_completed(step, loss=loss.item())

anyio.run(main)
with open(sys.argv[2], "w") as done:
    done.write("training finished")
"""


def _train(
    tmp_path: Path, *, setup: str = "", close_stdout: bool
) -> tuple[subprocess.CompletedProcess[bytes], Path, Path]:
    """Run a short training script; with *close_stdout*, its stdout is a pipe closed at once."""
    script = tmp_path / "train.py"
    script.write_text(_TRAIN.format(setup=textwrap.dedent(setup)), encoding="utf-8")
    logs, done = tmp_path / "logs", tmp_path / "done"
    cmd = [sys.executable, str(script), str(logs), str(done)]
    if close_stdout:  # `python train.py | head -0`: the reader is gone before anything is written
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read()
        proc.stderr.close()
        code = proc.wait(timeout=100)
        return subprocess.CompletedProcess(cmd, code, b"", err), logs, done
    result = subprocess.run(cmd, capture_output=True, timeout=100, check=False)
    return result, logs, done


def test_training_survives_a_closed_stdout_and_the_library_is_silent(tmp_path: Path) -> None:
    """With stdout closed (`| head -0`) and nothing configured, training finishes and nothing is said."""
    result, logs, done = _train(tmp_path, close_stdout=True)
    assert result.returncode == 0, result.stderr.decode()
    assert done.read_text() == "training finished"
    events = list(read_events(logs))
    assert any(isinstance(e, SinkFailed) for e in events)  # the library had things to report
    assert isinstance(events[-1], SessionEnded)  # and the log kept its end-of-session record
    assert result.stderr == b""  # silent until the application configures logging


def test_nothing_is_written_to_stdout(tmp_path: Path) -> None:
    """Even with logging configured by the application (to stderr), stdout stays empty."""
    setup = """
        import logging
        logging.basicConfig(level=logging.INFO)
    """
    result, _, done = _train(tmp_path, setup=setup, close_stdout=False)
    assert result.returncode == 0, result.stderr.decode()
    assert done.exists()
    assert result.stdout == b""
    err = result.stderr.decode()
    assert "eventbus_debug" in err and "sink" in err  # the application asked to see them


def test_a_log_handler_on_a_closed_pipe_never_stops_training(tmp_path: Path) -> None:
    """An application logging to stdout piped into a closed reader loses lines, not the run."""
    setup = """
        import logging
        logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    """
    _, logs, done = _train(tmp_path, setup=setup, close_stdout=True)
    assert done.read_text() == "training finished"
    assert isinstance(list(read_events(logs))[-1], SessionEnded)


@pytest.fixture
def library_records() -> Iterator[list[logging.LogRecord]]:
    """Records reaching a handler on the root logger, as an application would install it."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.NOTSET)
    root = logging.getLogger()
    package = logging.getLogger(LOGGER_NAME)
    previous = package.level
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        package.setLevel(previous)


def test_set_level_on_the_package_logger_controls_every_module(
    library_records: list[logging.LogRecord],
) -> None:
    """logging.getLogger("eventbus_debug").setLevel(...) governs the modules' loggers."""
    bus_log = get_logger("eventbus_debug._bus")
    sink_log = get_logger("sinks.console")  # the sinks package logs under eventbus_debug too
    logging.getLogger(LOGGER_NAME).setLevel(logging.WARNING)
    bus_log.info("hidden_info")
    sink_log.warning("shown_warning", sink="console")
    logging.getLogger(LOGGER_NAME).setLevel(logging.INFO)
    bus_log.info("shown_info", seconds=1.23456)
    assert [r.getMessage() for r in library_records] == [
        "shown_warning sink=console",
        "shown_info seconds=1.235",
    ]
    assert [r.name for r in library_records] == [
        "eventbus_debug.sinks.console",
        "eventbus_debug._bus",
    ]
    assert library_records[0].eventbus_debug == {"sink": "console"}  # type: ignore[attr-defined]
    assert library_records[1].pathname == __file__  # the caller's location, not structlog's


def test_a_log_line_never_raises(
    library_records: list[logging.LogRecord], capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk under the handler, a raising filter or an unprintable value raise nothing."""

    class FullDisk(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("cannot print me")

    def raising_filter(record: logging.LogRecord) -> bool:
        raise RuntimeError("a broken filter")

    log = get_logger("eventbus_debug.tests")
    logger = logging.getLogger("eventbus_debug.tests")
    logging.getLogger(LOGGER_NAME).setLevel(logging.INFO)
    full = logging.StreamHandler(FullDisk())
    logger.addHandler(full)
    try:
        log.warning("disk_full_below", step=1)  # the handler fails: handleError, not a raise
        log.warning("bad_value", value=Unprintable())
        logger.addFilter(raising_filter)
        log.error("filtered")
    finally:
        logger.removeHandler(full)
        logger.removeFilter(raising_filter)
    assert [r.getMessage() for r in library_records] == [
        "disk_full_below step=1",
        'bad_value value="<unprintable Unprintable>"',  # the value left out, not the line
    ]
    assert "No space left on device" in capsys.readouterr().err  # logging's own report


def test_library_adds_only_a_null_handler_and_never_configures_structlog() -> None:
    """The package logger has only a NullHandler; structlog's global config is untouched."""
    import sinks  # noqa: F401  (importing every module must not configure anything)

    handlers = logging.getLogger(LOGGER_NAME).handlers
    assert [type(h) for h in handlers] == [logging.NullHandler]
    assert not structlog.is_configured()
    assert logging.getLogger().handlers == [] or all(
        type(h).__module__.startswith("_pytest") for h in logging.getLogger().handlers
    )


def test_get_logger_names() -> None:
    """Names outside the hierarchy are placed under it; an empty name is refused."""
    assert get_logger("sinks.wandb")._logger.name == "eventbus_debug.sinks.wandb"
    assert get_logger()._logger.name == "eventbus_debug"
    with pytest.raises(TypeError, match="non-empty string"):
        get_logger("")
