"""Healthy DDP runs the agreement must leave alone, and faults it must answer as one process would.

Regressions of the overlapped agreement (launched from a hook on the model's first output): a
first output used in the loss on some ranks only hung the group, one used nowhere crashed DDP
with ``find_unused_parameters``/``static_graph``, restores were deferred (a NaN parameter cost
three skips and two restores, two of them three steps apart stopped the run) and non-finite
gradients seen by one rank's probe only made that rank skip alone. The default agreement blocks
at the safe point on every rank; ``Join([model, session.agreement])`` trains on uneven inputs.
Real gloo groups, each bounded by a timeout.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from eventbus_debug.recovery.agreement import AGREE_TIMEOUT

from .test_agreement import STEPS, ranks, run_group

HEALTHY = (
    "aux_some_ranks",
    "first_unused_find_unused",
    "first_unused_static",
    "nan_param_late",
    "nan_param_twice",
    "level_off_inf_grad",
    "inf_grad_after_one_rank",
    "join_uneven",
    "join_model_only",
    "join_agreement_first",
)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return run_group(tmp_path_factory.mktemp("healthy"), HEALTHY, 2)


def same_everywhere(results: list[Any], key: str) -> bool:
    return len({json.dumps(r[key]) for r in results}) == 1


@pytest.mark.parametrize(
    "scenario", ["aux_some_ranks", "first_unused_find_unused", "first_unused_static"]
)
def test_healthy_models_with_an_auxiliary_first_output_train_to_the_end(
    healthy: dict[str, list[Any]], scenario: str
) -> None:
    """A first output used in the loss on rank 0 only, or on no rank (with DDP's
    find_unused_parameters or static_graph): no hang, no crash, no action, equal parameters."""
    results = ranks(healthy, scenario)
    assert [r["stopped_at"] for r in results] == [None, None]
    assert [r["steps_completed"] for r in results] == [STEPS, STEPS]
    assert all(r["applied"] == [] and r["skipped"] == [] for r in results)
    assert same_everywhere(results, "params")


def test_a_nan_parameter_costs_one_skip_and_one_restore(healthy: dict[str, list[Any]]) -> None:
    """A NaN parameter on rank 1 at step 20: every rank skips step 20 and restores once, as a
    single process does (the overlapped agreement deferred it: 3 skips and 2 restores)."""
    results = ranks(healthy, "nan_param_late")
    assert all(r["skipped"] == [20] and r["restores"] == 1 for r in results)
    assert all(r["stopped_at"] is None and r["finite"] for r in results)
    assert same_everywhere(results, "applied") and same_everywhere(results, "params")


def test_two_nan_parameters_three_steps_apart_do_not_stop(healthy: dict[str, list[Any]]) -> None:
    """Two NaN parameters on rank 1 (steps 20 and 23): two skips, two restores, no stop."""
    results = ranks(healthy, "nan_param_twice")
    assert all(r["skipped"] == [20, 23] and r["restores"] == 2 for r in results)
    assert all(r["stopped_at"] is None and r["finite"] for r in results)
    assert same_everywhere(results, "params")


@pytest.mark.parametrize("scenario", ["level_off_inf_grad", "inf_grad_after_one_rank"])
def test_non_finite_gradients_seen_by_one_rank_are_skipped_by_every_rank(
    healthy: dict[str, list[Any]], scenario: str
) -> None:
    """An infinite gradient that only rank 1's probe sees (rank 0's level is off, or rank 1's
    gradient changed after DDP's all-reduce): both ranks skip step 21 and go on, equal."""
    results = ranks(healthy, scenario)
    assert all(r["skipped"] == [21] for r in results)
    assert all(r["stopped_at"] is None and r["finite"] for r in results)
    assert same_everywhere(results, "params")


def test_join_with_the_agreement_trains_on_uneven_inputs(healthy: dict[str, list[Any]]) -> None:
    """Rank 1 has 5 batches fewer, under Join([model, session.agreement]): its join hook shadows
    the agreement; nobody stops, and DDP's join leaves the ranks' parameters equal."""
    results = ranks(healthy, "join_uneven")
    assert [r["stopped_at"] for r in results] == [None, None]
    assert [r["steps_completed"] for r in results] == [STEPS, STEPS - 5]
    assert same_everywhere(results, "params") and all(r["finite"] for r in results)


@pytest.mark.parametrize(
    ("scenario", "says"),
    [
        ("join_model_only", "Join([model, session.agreement])"),
        ("join_agreement_first", "after the model"),
    ],
)
def test_join_without_the_agreement_is_a_clear_error_at_once(
    healthy: dict[str, list[Any]], scenario: str, says: str
) -> None:
    """model.join() alone (the agreement's collective is not shadowed) or the agreement before
    the model in Join: every rank raises at its first safe point, saying what to write,
    instead of a stall until the agreement's timeout."""
    results = ranks(healthy, scenario)
    assert [r["stopped_at"] for r in results] == [0, 0]
    assert all(says in r["reason"] for r in results)


def test_the_default_timeout_outlasts_a_rank_zero_checkpoint() -> None:
    """A rank pausing for minutes (a rank-0-only checkpoint or evaluation) is healthy."""
    assert AGREE_TIMEOUT >= 300.0
