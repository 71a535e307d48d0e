"""Which checks are due at which step: the level, the cadence, and the cache of the answers."""

from __future__ import annotations

import pytest

from eventbus_debug.probes import Cadence, Checks, DebugLevel, Thresholds
from eventbus_debug.probes.levels import checks_due


def test_off_checks_nothing() -> None:
    """OFF: no check is due at any step."""
    assert not any(checks_due(DebugLevel.OFF, Cadence(), s).any for s in range(20))


def test_basic_and_advanced_follow_the_cadence() -> None:
    """BASIC: loss and grads every step, params every 10th; ADVANCED adds layers and updates."""
    cadence = Cadence()
    assert checks_due(DebugLevel.BASIC, cadence, 10) == Checks(
        loss=True, grads=True, params=True, vanishing=True
    )
    assert checks_due(DebugLevel.BASIC, cadence, 3) == Checks(loss=True, grads=True)
    assert checks_due(DebugLevel.ADVANCED, cadence, 3) == Checks(loss=True, grads=True, layers=True)
    assert checks_due(DebugLevel.ADVANCED, cadence, 20).updates


def test_extreme_runs_everything_but_activations_follow_their_cadence() -> None:
    """EXTREME: every check every step; activation statistics every activation_every steps."""
    cadence = Cadence(activation_every=2)
    odd, even = (
        checks_due(DebugLevel.EXTREME, cadence, 3),
        checks_due(DebugLevel.EXTREME, cadence, 4),
    )
    assert odd.params and odd.updates and odd.vanishing and not odd.activations
    assert even.activations


def test_answers_are_built_once() -> None:
    """The same residues give the same Checks object (no allocation per step)."""
    cadence = Cadence(grad_every=2)
    assert checks_due(DebugLevel.BASIC, cadence, 2) is checks_due(DebugLevel.BASIC, cadence, 4)
    assert not checks_due(DebugLevel.BASIC, cadence, 3).grads


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("vanishing", 0.0, "vanishing must be a finite number > 0"),
        ("explosion", -1.0, "explosion must be a finite number > 0"),
        ("spike_atol", -1.0, "spike_atol must be a finite number >= 0"),
        ("spike_window", 0, "spike_window must be an int >= 1"),
    ],
)
def test_thresholds_refuse_bad_values(field: str, value: object, match: str) -> None:
    """Each threshold names itself and the rule when its value is refused."""
    with pytest.raises(ValueError, match=match):
        Thresholds(**{field: value})  # type: ignore[arg-type]


def test_no_explosion_cap_is_allowed() -> None:
    """explosion=None switches the absolute cap off."""
    assert Thresholds(explosion=None).explosion is None


def _expected(level: DebugLevel, cadence: Cadence, step: int) -> Checks:
    """The due checks written out from the cadence's definition (step % every == 0)."""
    if level is DebugLevel.OFF:
        return Checks()
    if level is DebugLevel.EXTREME:
        return Checks(
            True, True, True, True, True, step % cadence.activation_every == 0, vanishing=True
        )
    grads = step % cadence.grad_every == 0
    return Checks(
        loss=step % cadence.loss_every == 0,
        grads=grads,
        params=step % cadence.param_every == 0,
        layers=level is DebugLevel.ADVANCED and grads,
        updates=level is DebugLevel.ADVANCED and step % cadence.update_every == 0,
        vanishing=grads and step % cadence.vanishing_every == 0,
    )


@pytest.mark.parametrize(
    "cadence",
    [
        Cadence(),
        Cadence(loss_every=3, grad_every=2, param_every=7, update_every=5, vanishing_every=4),
        # a pattern longer than the table kept (lcm 997 x 991): computed step by step
        Cadence(param_every=997, update_every=991),
        Cadence(activation_every=6),
    ],
)
def test_checks_due_follows_the_cadence_at_every_step(cadence: Cadence) -> None:
    """The table of a repeating pattern gives what each step's cadence says, for every level,
    also when levels and cadences alternate between calls (two probes in one process)."""
    other = Cadence(param_every=3)
    for step in [*range(2_100), 982_081, 10**9 + 7]:
        for level in DebugLevel:
            assert checks_due(level, cadence, step) == _expected(level, cadence, step)
            assert checks_due(level, other, step) == _expected(level, other, step)


def test_checks_any_is_whether_something_is_due() -> None:
    assert not Checks().any
    assert Checks(loss=True).any and Checks(activations=True).any
    assert not Checks(layers=True, vanishing=True).any  # parts of the gradient check only
