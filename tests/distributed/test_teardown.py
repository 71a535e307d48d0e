"""A closed agreement leaves no collective in flight and keeps no model alive (real gloo, 2 ranks).

An overlapped agreement launches its ``all_reduce`` during DDP's ``backward()``; a session that
ends before the next safe point (a ``break`` between ``backward()`` and ``check_step``) closed
its agreement with that collective still in flight on the group, for gloo's threads to finish
while the process went on, or exited under them. Here rank 1 launches a second after rank 0,
which closes at once: its close must wait for the collective. And a closed agreement, retired until
the next one is built, kept the session's model (with the model's process group) alive.

Run as ``python -m tests.distributed.test_teardown RANK WORLD INIT_FILE OUT_DIR`` for one rank
(the tests start the ranks).
"""

from __future__ import annotations

import gc
import json
import sys
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from eventbus_debug.events import Anomaly
from eventbus_debug.recovery.actions import DecidedAction
from eventbus_debug.recovery.agreement import RankAgreement

from ._ranks import run_ranks

LIMIT = 60.0  # seconds for the whole group; a regression fails instead of hanging


class _NothingDecided:
    """A decision source with nothing to agree on (the agreement's engine)."""

    def take_for_agreement(self) -> tuple[tuple[DecidedAction, ...], int]:
        return (), 0

    def answers(self, incident: Anomaly) -> bool:
        return False


def _rank_main(rank: int, world: int, init: str, out: Path) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 1))
    agreement = RankAgreement(overlap=True, timeout=30.0)
    result: dict[str, Any] = {"attached": agreement.attach(model, _NothingDecided())}
    if rank == 1:
        time.sleep(1.0)  # rank 0's collective waits for this rank's launch meanwhile
    agreement._launch(False)  # what the output gradient's hook runs; no safe point follows
    launched = agreement._launched
    result["launched"] = launched is not None and launched.work is not None
    agreement.close()
    result["in_flight_after_close"] = launched is not None and not launched.work.is_completed()
    result["launched_after_close"] = agreement._launched is not None
    alive = weakref.ref(model)
    del model, launched
    gc.collect()
    result["model_alive_after_close"] = alive() is not None
    # An agreement given as distributed= is detached (not closed) at each session's end, to
    # serve the next session: the same wait applies.
    given = RankAgreement(overlap=True, timeout=30.0)
    given.attach(DistributedDataParallel(nn.Linear(4, 1)), _NothingDecided())
    if rank == 0:
        time.sleep(1.0)  # this time rank 1 waits for rank 0's launch
    given._launch(False)
    in_flight = given._launched
    given.detach()
    result["in_flight_after_detach"] = in_flight is not None and not in_flight.work.is_completed()
    result["launched_after_detach"] = given._launched is not None
    given.close()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("teardown")
    outputs = run_ranks("tests.distributed.test_teardown", [], 2, tmp, LIMIT)
    paths = [tmp / f"rank{r}.json" for r in range(2)]
    if not all(p.exists() for p in paths):
        pytest.fail(f"a rank wrote no result:\n{outputs}")
    return [json.loads(p.read_text()) for p in paths]


def test_close_waits_for_the_agreement_launched_during_backward(
    ranks: list[dict[str, Any]],
) -> None:
    """The collective launched in backward is complete when close() returns, and forgotten."""
    for result in ranks:
        assert result["attached"] and result["launched"]
        assert result["in_flight_after_close"] is False
        assert result["launched_after_close"] is False


def test_a_closed_agreement_keeps_no_model_alive(ranks: list[dict[str, Any]]) -> None:
    """The retired agreement drops the session's model (and with it the model's group)."""
    for result in ranks:
        assert result["model_alive_after_close"] is False


def test_detach_waits_too(ranks: list[dict[str, Any]]) -> None:
    """A given agreement, detached at a session's end, leaves no collective in flight either."""
    for result in ranks:
        assert result["in_flight_after_detach"] is False
        assert result["launched_after_detach"] is False


if __name__ == "__main__":
    _rank, _world, _init, _out = sys.argv[1:5]
    _rank_main(int(_rank), int(_world), _init, Path(_out))
