"""The host side of a step check: one step's numbers -> a :class:`StepVerdict` and its events.

:class:`Judge` reads the values :class:`~._launch.Launcher` put in the step's vector and
decides: non-finite values, gradient explosion, vanishing gradients and dead layers, loss
spikes, weight-update ratios and activation statistics. It publishes nothing itself: it returns
the incidents and the step's :class:`~eventbus_debug.events.StepChecked` telemetry for the
probe to publish. The only device work it may ask for runs on a fire (NaN/Inf counts, the
parameters' norms when they were not due).

Everything per step is C-level iteration over Python floats (``math.fsum``, ``map``, ``any``);
per-parameter Python work happens only for parameters that are low or dead (:mod:`._dead_layers`
judges each against its own gradient history).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, Final, NamedTuple

import torch

from eventbus_debug.diagnostics import get_logger

from ..._saved import StateReader
from ...events import (
    Event,
    GradientExploded,
    GradientVanished,
    LossSpiked,
    NonFiniteDetected,
    StepChecked,
    TensorRole,
    UsageWarning,
)
from ..levels import Thresholds
from ._dead_layers import DeadLayers
from ._explosions import ExplosionDetector
from ._launch import Layout, Pending
from ._partial import PartialBatches
from ._spikes import LossSpikeDetector
from .verdict import StepVerdict

__all__ = ("Judge", "Judgement")

_log = get_logger(__name__)

_CONVERGED: Final = 1e-6
"""A loss within this fraction of the largest loss the run had has converged: gradients near
zero are then the optimum, not a vanishing problem."""

RecheckState = Callable[[], tuple[list[float], tuple[int, ...]]]
"""Reads every parameter's and buffer's norm now (one transfer); only called on a fire."""


class Judgement(NamedTuple):
    """What the judge decided for one step: the verdict and the events to publish, in order.

    A named tuple (immutable, typed), built once per step: cheaper than a dataclass.
    """

    verdict: StepVerdict
    events: tuple[Event, ...]


class _Slots:
    """Per-layout constants of the gradient checks, built once per gradient plan."""

    __slots__ = ("inv_sqrt", "names", "numel", "slots", "sqrt_numel")

    def __init__(
        self, slots: tuple[int, ...], numels: tuple[int, ...], names: tuple[str, ...]
    ) -> None:
        self.slots = slots
        self.names = tuple(names[s] for s in slots)
        self.numel = sum(numels)
        self.sqrt_numel = math.sqrt(self.numel)
        # 1/sqrt(n); nan for empty tensors, which are then never "low"
        self.inv_sqrt = [1.0 / math.sqrt(n) if n else math.nan for n in numels]


class Judge:
    """Judges the steps of one model's probe, keeping the state the detectors need.

    Args:
        names: the checked parameters' names, by slot.
        state_names: the parameters' then the floating buffers' names, by slot.
        thresholds: when the checks fire.
        scaler: the AMP ``GradScaler`` (its overflow steps are not incidents).
        source: the ``source`` stamped on events.
        global_spikes: loss spikes are judged only in :meth:`spike`, on the ranks' mean loss.
    """

    def __init__(
        self,
        names: tuple[str, ...],
        state_names: tuple[str, ...],
        thresholds: Thresholds,
        *,
        scaler: torch.amp.GradScaler | None,
        source: str,
        global_spikes: bool,
    ) -> None:
        self._names = names
        self._state_names = state_names
        self._n_params = len(names)
        self._scaler = scaler
        self.source = source
        self.global_spikes = global_spikes
        """Loss spikes are judged only in :meth:`spike`, on the ranks' mean loss."""
        self._loss_scale = 0.0
        self._converged = False
        self.lr: float | None = None
        """The learning rate of the step being judged (the probe reads it from the optimizer
        at each check; ``None``: unknown). A loss or gradient norm climbing back after the LR
        rose (a warm restart) is judged against the run's levels at that LR."""
        self.l1_wanted = True
        """Whether the next vanishing-due step needs the mean ``|grad|`` pass: decided from the
        last judged gradients (``mean|g| >= Σ‖g‖₂ / n``, so while that bound clears the
        threshold no gradient can have vanished) and never while the loss has converged."""
        self._partial = PartialBatches()
        """Whether the step judged is a partial batch (an epoch's short last one)."""
        self._layers = DeadLayers(
            len(names),
            relative=thresholds.vanishing_relative,
            patience=thresholds.vanishing_patience,
        )
        self._slots: _Slots | None = None
        self._vanish_streak = 0
        self._vanish_reported = False
        self._param_base: tuple[int, tuple[int, ...], Sequence[float]] = (-1, (), ())
        self._ratios_warned: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self._scaler_hinted = False
        self._no_gradients_said = False
        self._said: list[UsageWarning] = []  # published with the next judged step's events
        self._spikes: LossSpikeDetector
        self._explosions: ExplosionDetector
        self.thresholds = thresholds

    @property
    def thresholds(self) -> Thresholds:
        """The thresholds; assigning new ones restarts the detectors."""
        return self._thresholds

    @thresholds.setter
    def thresholds(self, th: Thresholds) -> None:
        self._thresholds = th
        self._spikes = LossSpikeDetector.from_thresholds(th)
        self._explosions = ExplosionDetector.from_thresholds(th)
        self._layers.configure(relative=th.vanishing_relative, patience=th.vanishing_patience)

    def rebaseline(self) -> None:
        """Restart the loss-spike and explosion windows (after a restore)."""
        self._spikes.reset()
        self._explosions.reset()

    def state(self) -> dict[str, Any]:
        """What the detectors learned of the run, as plain values (see :meth:`load`)."""
        return {
            "loss_scale": self._loss_scale,
            "converged": self._converged,
            "vanish_streak": self._vanish_streak,
            "vanish_reported": self._vanish_reported,
            "l1_wanted": self.l1_wanted,
            "spikes": self._spikes.state(),
            "explosions": self._explosions.state(),
            "layers": self._layers.state(self._names),
        }

    def load(self, state: StateReader) -> None:
        """Continue from a :meth:`state`: the detectors judge the next step as the run that
        saved it would have (the thresholds stay this judge's own).

        Raises:
            ValueError: if a field is missing or malformed (the message names it); nothing
                is changed then.
        """
        # Loaded into fresh detectors first: a malformed state leaves this judge as it was.
        th = self._thresholds
        spikes = LossSpikeDetector.from_thresholds(th)
        spikes.load(state.child("spikes"))
        explosions = ExplosionDetector.from_thresholds(th)
        explosions.load(state.child("explosions"))
        layers = DeadLayers(
            len(self._names), relative=th.vanishing_relative, patience=th.vanishing_patience
        )
        layers.load(state.child("layers"), self._names)
        loss_scale = state.number("loss_scale")
        converged = state.flag("converged")
        vanish_streak = state.count("vanish_streak")
        vanish_reported = state.flag("vanish_reported")
        l1_wanted = state.flag("l1_wanted")
        self._spikes, self._explosions, self._layers = spikes, explosions, layers
        self._loss_scale, self._converged = loss_scale, converged
        self._vanish_streak, self._vanish_reported = vanish_streak, vanish_reported
        self.l1_wanted = l1_wanted
        self._slots = None

    # -- one step -------------------------------------------------------------------------------

    def judge(
        self, pending: Pending, values: list[float], *, deferred: bool, recheck: RecheckState
    ) -> Judgement:
        """Decide *pending*'s step from its *values*; *recheck* reads the state norms on a fire."""
        lay = pending.layout
        step = lay.step
        widen = self._partial.judge(step, lay.samples)
        incidents: list[Event] = []
        pos = 0
        loss_value: float | None = lay.host_loss
        if lay.has_loss:
            # float(): an integer loss tensor alone in the vector reads back as an int
            loss_value = float(values[0])
            pos = 1
        loss_finite = True
        if loss_value is not None:
            if math.isfinite(loss_value):
                # else on the ranks' mean loss, in :meth:`scale`; a partial batch's loss is
                # not the run's scale
                if not self.global_spikes and widen == 1.0:
                    self.scale(loss_value)
            else:
                loss_finite = False
                incidents.append(
                    NonFiniteDetected(
                        step=step,
                        source=self.source,
                        role=TensorRole.LOSS,
                        names=("loss",),
                        nan_count=int(math.isnan(loss_value)),
                        inf_count=int(math.isinf(loss_value)),
                    )
                )
        finite = loss_finite
        grad_norm: float | None = None
        overflow = False
        layer_norms: dict[str, float] = {}
        k = len(lay.grad_slots)
        if k:
            l2 = values[pos : pos + k]
            pos += k
            l1: list[float] = []
            if lay.with_l1:
                l1 = values[pos : pos + k]
                pos += k
            grad_norm, grad_finite = self._judge_grads(
                pending, l2, l1, step, incidents, loss_finite=loss_finite
            )
            if not grad_finite:
                finite = False
                overflow = loss_finite and not incidents
            if lay.checks.layers:
                layer_norms = dict(zip(self._slot_names(lay.grad_slots), l2, strict=True))
        if loss_value is not None and loss_finite and not overflow and not self.global_spikes:
            spike = self.spike(step, loss_value, widen=widen)
            if spike is not None:
                incidents.append(spike)
        param_norm: float | None = None
        m = len(lay.param_slots)
        u = len(lay.update_slots)
        # judged against the base of the previous snapshot, before this step's becomes the base
        ratios = self._ratios(lay, values[pos + m : pos + m + u])
        bad: list[int] = []
        if m:
            p2 = values[pos : pos + m]
            param_norm, bad = self._param_norm(lay.param_slots, p2)
            self._param_base = (step, lay.param_slots, p2)  # the base of the next ratios
        elif not finite and not overflow and self._state_names:
            # The loss or the gradients are not finite and the parameters were not due: look
            # at them now (one more transfer, only on a fire) so that a NaN parameter or
            # buffer is restored at this step, not up to param_every steps later.
            norms, slots = recheck()
            bad = self._bad_slots(slots, norms)
        pos += m + u
        if bad:
            finite = False
            n_params = self._n_params
            params = [s for s in bad if s < n_params]
            buffers = [s for s in bad if s >= n_params]
            if params:
                incidents.append(self._non_finite(TensorRole.PARAMETER, params, None, step))
            if buffers:
                incidents.append(self._non_finite(TensorRole.BUFFER, buffers, None, step))
        dead: dict[str, float] = {}
        saturated: dict[str, float] = {}
        if lay.activations:
            for slot, v in zip(lay.activations, values[pos:], strict=False):
                (dead if slot.kind == "dead" else saturated)[slot.name] = slot.fraction(v)
        fired = tuple(e.kind for e in incidents) if incidents else ()
        if lay.no_gradients and not self._no_gradients_said:
            self._no_gradients(step)
        if self._said:  # after `fired`: what the loop got wrong, not what the step did
            incidents += self._said
            self._said.clear()
        incidents.append(
            StepChecked(
                step=step,
                source=self.source,
                loss=loss_value,
                grad_norm=grad_norm,
                param_norm=param_norm,
                finite=finite,
                fired=fired,
                layer_grad_norms=layer_norms,
                update_ratios=ratios,
                dead_fractions=dead,
                saturated_fractions=saturated,
                deferred=deferred,
            )
        )
        verdict = StepVerdict(
            step=step,
            finite=finite,
            loss=loss_value,
            grad_norm=grad_norm,
            param_norm=param_norm,
            fired=fired,
            deferred=deferred,
            overflow=overflow,
        )
        return Judgement(verdict, tuple(incidents))

    def scale(self, loss: float) -> None:
        """Take one finite loss into the run's largest loss and whether the loss converged
        from it (which silences the vanishing checks).

        With ``global_spikes`` it is the ranks' mean loss (:meth:`StepProbe.observe_global_loss
        <eventbus_debug.StepProbe.observe_global_loss>`), not the rank's own: every rank's
        convergence, and the vanishing checks and state it gates, are then the same, so one
        rank's :meth:`state` resumes every rank exactly.
        """
        scale = abs(loss)
        if scale > self._loss_scale:
            self._loss_scale = scale
        self._converged = scale <= _CONVERGED * self._loss_scale

    def spike(self, step: int, loss: float, *, widen: float = 1.0) -> LossSpiked | None:
        """Judge one finite loss for spikes; the incident, or ``None``. *widen* > 1: the loss
        of a partial batch, judged that many times more leniently and not learned from."""
        if widen == 1.0:
            verdict = self._spikes.observe(loss, self.lr)
        else:
            verdict = self._spikes.observe_partial(loss, widen)
        if verdict is None:
            return None
        base = verdict.baseline
        return LossSpiked(
            step=step,
            source=self.source,
            loss=loss,
            running_mean=base,
            ratio=loss / base if base else math.inf,
            rule=verdict.rule.value,
            tolerance=verdict.tolerance,
            streak=verdict.streak,
        )

    def say(self, step: int, problem: str, message: str) -> None:
        """A usage *problem* found at *step*: logged now, and published as a
        :class:`~eventbus_debug.events.UsageWarning` with the next judged step's events (so
        from the loop's thread, whichever thread judged)."""
        _log.warning(problem, step=step, hint=message)
        self._said.append(
            UsageWarning(step=step, source=self.source, problem=problem, message=message)
        )

    def widen_at(self, step: int) -> float:
        """How much more leniently *step*'s loss is judged: the last judged step's partial-batch
        widening when it is *step*, else 1.0 (a ranks' mean loss of a partial batch, judged
        after the ranks agreed: every rank had the same samples under ``DistributedSampler``)."""
        return self._partial.widen_at(step)

    # -- parts ----------------------------------------------------------------------------------

    def _no_gradients(self, step: int) -> None:
        """A due gradient check found no gradient: said once, since the checks then see
        nothing for the whole run."""
        self._no_gradients_said = True
        self.say(
            step,
            "no_gradients_at_check",
            "check_step found no gradient to check: call it after loss.backward() and before "
            "optimizer.step() (before backward, or after zero_grad, the checks see nothing)",
        )

    def _param_norm(self, slots: tuple[int, ...], p2: list[float]) -> tuple[float, list[int]]:
        """The parameters' total norm (buffers left out) and the non-finite slots."""
        n_params = self._n_params
        everything = math.fsum(map(operator.mul, p2, p2))
        if len(self._state_names) == n_params:
            squares = everything
        else:
            squares = math.fsum(v * v for s, v in zip(slots, p2, strict=True) if s < n_params)
        if math.isfinite(everything):  # then no value is NaN or Inf
            return math.sqrt(squares), []
        return math.sqrt(squares), self._bad_slots(slots, p2)

    def _bad_slots(self, slots: Sequence[int], norms: Sequence[float]) -> list[int]:
        """The slots whose norm says a fault: a parameter's NaN or Inf, a buffer's NaN.

        An infinite buffer is the model's own: a causal attention mask of ``-inf`` above the
        diagonal, a running minimum started at ``inf``. Flagged, it stopped a healthy GPT at
        step 0 (a restore required before any good state was held). A NaN in a buffer (a
        BatchNorm's running mean after a NaN batch) is a fault: the norm of a tensor holding
        one is NaN, whatever else it holds.
        """
        n_params = self._n_params
        return [
            s
            for s, v in zip(slots, norms, strict=True)
            if (not math.isfinite(v) if s < n_params else math.isnan(v))
        ]

    def _ratios(self, lay: Layout, d2: list[float]) -> dict[str, float]:
        """‖Δw‖/‖w‖ per parameter, ‖w‖ being the norms judged at the snapshot step."""
        if not d2:
            return {}
        base_step, base_slots, base_values = self._param_base
        if base_step != lay.update_base:
            return {}  # the snapshot step's norms were not judged (restarted in between)
        slots = lay.update_slots
        names = self._names
        ratios: dict[str, float]
        n = len(slots)
        if base_slots[:n] == slots and all(map(operator.gt, base_values[:n], repeat(0.0))):
            # the usual layout (the same parameters first, every norm > 0): C-level iteration
            ratios = dict(
                zip(
                    map(names.__getitem__, slots),
                    map(operator.truediv, d2, base_values),
                    strict=True,
                )
            )
        else:
            w = dict(zip(base_slots, base_values, strict=True))
            ratios = {}
            for s, d in zip(slots, d2, strict=True):
                norm = w.get(s, math.nan)
                ratios[names[s]] = d / norm if norm > 0 else (0.0 if d == 0 else math.inf)
        th = self._thresholds
        values = ratios.values()
        if not any(map(operator.lt, values, repeat(th.update_ratio_low))) and not any(
            map(operator.gt, values, repeat(th.update_ratio_high))
        ):
            self._ratios_warned = None
            return ratios  # every ratio within bounds (the healthy step)
        low = tuple(n for n, r in ratios.items() if r < th.update_ratio_low)
        # inf: the parameter's norm was 0 at the snapshot (a zero-initialized bias): no scale
        high = tuple(n for n, r in ratios.items() if th.update_ratio_high < r < math.inf)
        if (low, high) != self._ratios_warned and (low or high):
            # Said once per change of the set: a parameter group at lr=0, a bias before a
            # BatchNorm (its gradient is 0) or a warm-up from 0 would repeat it every check.
            self._ratios_warned = (low, high)
            _log.warning(
                "weight_update_ratio_out_of_bounds",
                step=lay.step,
                stalled=list(low[:10]),
                too_large=list(high[:10]),
            )
        return ratios

    def _judge_grads(
        self,
        pending: Pending,
        l2: list[float],
        l1: list[float],
        step: int,
        incidents: list[Event],
        *,
        loss_finite: bool,
    ) -> tuple[float, bool]:
        """The total norm and whether the gradients are finite; incidents go to *incidents*."""
        lay = pending.layout
        total = math.sqrt(math.fsum(map(operator.mul, l2, l2)))
        if not math.isfinite(total):
            bad = [j for j, v in enumerate(l2) if not math.isfinite(v)]
            counts = pending.count_non_finite(bad)
            really_bad = [j for j, (n, i) in zip(bad, counts, strict=True) if n or i or n is None]
            if really_bad:
                if self._scaler is not None and self._scaler.is_enabled() and loss_finite:
                    # A GradScaler overflow: scaler.step() skips the update and halves the
                    # scale. Routine in fp16 training, not an incident (the session reports
                    # a StepSkipped with the scales once scaler.update() ran).
                    return total, False
                if self._scaler is None and loss_finite and not self._scaler_hinted:
                    self._scaler_hinted = True  # said once a run; a hint, not a sure misuse
                    _log.warning(  # (a NaN gradient of a real fault reads the same): log only
                        "non_finite_gradients_with_finite_loss",
                        step=step,
                        hint="if this run uses torch.amp.GradScaler, pass scaler= (Session(..., "
                        "scaler=scaler)): its overflow steps are then the scaler's to skip, "
                        "not incidents that skip and restore",
                    )
                known = [c for c in counts if c[0] is not None]
                nan = sum(c[0] or 0 for c in known) if known else None
                inf = sum(c[1] or 0 for c in known) if known else None
                slots = [lay.grad_slots[j] for j in really_bad]
                incidents.append(self._non_finite(TensorRole.GRADIENT, slots, (nan, inf), step))
                return total, False
            # finite values whose fp32 sum of squares overflowed: judge the float64 norm (the
            # overflowed tensors' norms read again in float64, never left out of the total)
            wide = dict(zip(bad, pending.wide_norms(bad), strict=True))
            l2 = [wide.get(j, v) for j, v in enumerate(l2)]
            total = math.sqrt(math.fsum(v * v for v in l2))
            if not math.isfinite(total):
                total = math.inf
        exploded = None
        if math.isfinite(total):
            widen = self._partial.widen
            if widen == 1.0:
                exploded = self._explosions.observe(total, self.lr)
            else:
                exploded = self._explosions.observe_partial(total, widen)
        if exploded is not None or total == math.inf:
            top = sorted(
                zip(self._slot_names(lay.grad_slots), l2, strict=True),
                key=lambda kv: -kv[1] if not math.isnan(kv[1]) else 0.0,
            )[: self._thresholds.top_k]
            incidents.append(
                GradientExploded(
                    step=step,
                    source=self.source,
                    total_norm=total,
                    threshold=exploded.threshold if exploded else math.inf,
                    top=tuple(top),
                    baseline=exploded.baseline if exploded else math.nan,
                    largest=exploded.largest if exploded else self._explosions.largest,
                    rule=exploded.rule if exploded else "cap",
                )
            )
        vanished = self._vanishing(lay, l2, l1, total, step)
        if vanished is not None:
            incidents.append(vanished)
        return total, True

    def _slots_of(self, lay: Layout) -> _Slots:
        """The per-layout constants of *lay*'s gradient positions (built once per plan)."""
        info = self._slots
        if info is None or info.slots is not lay.grad_slots:
            info = self._slots = _Slots(lay.grad_slots, lay.grad_numels, self._names)
        return info

    def _slot_names(self, slots: tuple[int, ...]) -> tuple[str, ...]:
        """The parameter names of *slots*, in order."""
        info = self._slots
        if info is not None and info.slots is slots:
            return info.names
        return tuple(self._names[s] for s in slots)

    def _vanishing(
        self, lay: Layout, l2: list[float], l1: list[float], total: float, step: int
    ) -> GradientVanished | None:
        """Dead layers and vanishing gradients: persistent, relative, never on a converged run.

        A parameter is a dead layer when its gradient's share of the model's (RMS over RMS)
        fell a thousandfold below what it used to be, and below ``vanishing_relative``, for
        ``vanishing_patience`` checks in a row (:class:`~._dead_layers.DeadLayers`): gradients
        that are zero by construction never had a share, and quiet but healthy parameters keep
        theirs. Each is reported once, when it dies. The whole model vanished when its mean
        ``|grad|`` stays below ``vanishing`` (or every gradient is exactly zero) while the loss
        has not converged. ``mean_abs`` is the model's, set only when the whole model vanished.
        """
        th = self._thresholds
        info = self._slots_of(lay)
        total_numel = info.numel
        if self._converged:
            self._vanish_streak = 0
            self._layers.calm()
            self.l1_wanted = False
            return None
        # a bound, not a reported value: sum (C, 3x cheaper than fsum) is exact enough
        self.l1_wanted = bool(total_numel) and sum(l2) / total_numel < th.vanishing
        all_zero = bool(l2) and not any(l2)
        dead: list[int] = []
        if th.vanishing_per_layer and total_numel and not all_zero:
            dead = self._layers.observe(info.slots, info.inv_sqrt, l2, total / info.sqrt_numel)
        mean_abs: float | None = None
        if not (l1 or all_zero):
            if not dead:
                return None  # the every-step case: no mean |grad| pass this step, no dead layer
            vanished = False
        else:
            if l1 and total_numel:
                mean_abs = math.fsum(l1) / total_numel
            vanished = all_zero or (mean_abs is not None and mean_abs < th.vanishing)
            self._vanish_streak = self._vanish_streak + 1 if vanished else 0
            if not vanished:
                self._vanish_reported = False
        model_fired = (
            vanished
            and (all_zero or self._vanish_streak >= th.vanishing_patience)
            and not self._vanish_reported
        )
        if model_fired:
            self._vanish_reported = True
        if not (model_fired or dead):
            return None
        # by name: the order of the gradient plan is an implementation detail
        layers = tuple(sorted(self._names[s] for s in (lay.grad_slots if all_zero else dead)))
        if model_fired:
            threshold = th.vanishing
            if all_zero:
                mean_abs = 0.0
        else:  # dead layers only: every named layer's share is below the threshold
            threshold = max(map(self._layers.threshold, dead))
            mean_abs = None
        return GradientVanished(
            step=step,
            source=self.source,
            mean_abs=mean_abs,
            threshold=threshold,
            layers=layers,
            all_zero=all_zero,
        )

    def _non_finite(
        self,
        role: TensorRole,
        slots: Sequence[int],
        counts: tuple[int | None, int | None] | None,
        step: int,
    ) -> NonFiniteDetected:
        nan, inf = counts if counts is not None else (None, None)
        return NonFiniteDetected(
            step=step,
            source=self.source,
            role=role,
            names=tuple(self._state_names[s] for s in slots),
            nan_count=nan,
            inf_count=inf,
        )
