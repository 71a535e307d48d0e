"""Dead layers: each parameter judged against its own gradient history, with hysteresis.

The unit tests drive :class:`DeadLayers` with synthetic gradient norms; the training runs check
the reason it exists: a transformer at Hugging Face's init (query/key gradients around 1e-4 of
the model's, wandering in and out of a fixed threshold) is healthy, and a layer that really dies
is still reported within the patience.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from eventbus_debug import DebugLevel, StepProbe, Thresholds
from eventbus_debug.events import Event, GradientVanished, StepChecked
from eventbus_debug.events.describe import describe
from eventbus_debug.log import decode_event, encode_event
from eventbus_debug.probes.step._dead_layers import (
    ALIVE,
    FALL,
    GROW,
    REFRESH,
    REVIVE,
    DeadLayers,
)
from eventbus_debug.recovery import ReportVanishing
from eventbus_debug.recovery.strategies import StrategyHistory
from tests._doubles import RecordingPublisher

PATIENCE = 10
RELATIVE = 1e-4
SLOTS = (0, 1, 2)
INV = [0.1, 0.1, 0.1]  # three parameters of 100 elements each


def _layers() -> DeadLayers:
    return DeadLayers(len(SLOTS), relative=RELATIVE, patience=PATIENCE)


def _norms(shares: tuple[float, float, float]) -> tuple[list[float], float]:
    """2-norms giving each parameter *shares* of a model RMS of 1, and that RMS."""
    return [share / inv for share, inv in zip(shares, INV, strict=True)], 1.0


def _feed(layers: DeadLayers, shares: list[tuple[float, float, float]]) -> list[tuple[int, int]]:
    """Observe each check's shares; (check, slot) of every death reported."""
    died: list[tuple[int, int]] = []
    for i, share in enumerate(shares):
        l2, rms = _norms(share)
        died += [(i, s) for s in layers.observe(SLOTS, INV, l2, rms)]
    return died


def _quiet(n: int, seed: int = 0) -> list[tuple[float, float, float]]:
    """Two ordinary parameters and a quiet one wandering over 0.3..1.5e-4 of the model."""
    rng = random.Random(seed)
    return [(1.0, 1.0, rng.uniform(0.3e-4, 1.5e-4)) for _ in range(n)]


class TestDeadLayers:
    def test_a_quiet_parameter_wandering_across_the_old_floor_never_dies(self) -> None:
        """Shares of 0.3..1.5e-4 (HF query/key at init) cross 1e-4 often: never dead."""
        assert _feed(_layers(), _quiet(5000)) == []

    def test_a_zero_gradient_dies_after_patience_and_is_reported_once(self) -> None:
        """Exactly zero from check 100 on: dead at check 100 + patience - 1, once."""
        died = _feed(_layers(), _quiet(100) + [(1.0, 1.0, 0.0)] * 300)
        assert died == [(100 + PATIENCE - 1, 2)]

    def test_a_thousandfold_fall_is_dead_a_hundredfold_fall_is_not(self) -> None:
        """A quiet parameter (1e-4) falling 2000x dies; falling 100x is a quieter phase."""
        base = [(1.0, 1.0, 1e-4)] * 200
        assert _feed(_layers(), base + [(1.0, 1.0, 1e-6)] * 200) == []
        assert _feed(_layers(), base + [(1.0, 1.0, 5e-8)] * 200) == [(200 + PATIENCE - 1, 2)]

    def test_a_busy_parameter_must_also_fall_below_vanishing_relative(self) -> None:
        """At share 1 the threshold is min(vanishing_relative, FALL): 2e-4 is not dead."""
        base = [(1.0, 1.0, 1.0)] * 100
        assert _feed(_layers(), base + [(1.0, 1.0, 2e-4)] * 100) == []
        assert _feed(_layers(), base + [(1.0, 1.0, 5e-5)] * 100) == [(100 + PATIENCE - 1, 2)]

    def test_rounding_noise_and_zero_by_construction_never_die(self) -> None:
        """A share below ALIVE (an attention key bias: 1e-10) or always zero: never dead."""
        noise = [(1.0, ALIVE / 100, 0.0)] * 100 + [(1.0, 0.0, 0.0)] * 100
        assert _feed(_layers(), noise) == []

    def test_hysteresis_a_dead_parameter_revives_only_well_above_its_threshold(self) -> None:
        """Back to 2x its threshold: still dead (no second report when it falls again); back
        above REVIVE x its threshold: alive, and dying again is reported again."""
        layers = _layers()
        base = [(1.0, 1.0, 1.0)] * 64
        threshold = RELATIVE  # min(vanishing_relative, FALL x 1.0)
        dead = [(1.0, 1.0, 0.0)] * PATIENCE
        hover = [(1.0, 1.0, 2 * threshold)] * 5 + [(1.0, 1.0, threshold / 2)] * 5
        died = _feed(layers, base + dead + hover * 20)
        assert died == [(64 + PATIENCE - 1, 2)]
        assert layers.threshold(2) == pytest.approx(threshold)
        back = [(1.0, 1.0, 2 * REVIVE * threshold)]
        died = _feed(layers, back + dead)
        assert died == [(PATIENCE, 2)]

    def test_one_outlier_barely_moves_the_reference(self) -> None:
        """A share 10,000x its usual at a refresh raises the reference GROW times at most."""
        layers = _layers()
        shares = [*_quiet(REFRESH), (1.0, 1.0, 1.0), *_quiet(3000, seed=1)[1:]]
        assert _feed(layers, shares) == []
        assert layers.threshold(2) <= FALL * 1.5e-4 * GROW

    def test_a_converged_loss_restarts_the_streaks(self) -> None:
        """calm() between two runs of patience - 1 low checks: no death."""
        layers = _layers()
        _feed(layers, [(1.0, 1.0, 1.0)] * 40)
        low = [(1.0, 1.0, 0.0)] * (PATIENCE - 1)
        assert _feed(layers, low) == []
        layers.calm()
        assert _feed(layers, low) == []

    def test_no_gradient_is_no_news(self) -> None:
        """A low parameter whose gradient is absent for a while keeps its streak (and a dead one
        stays dead); the layout change keeps every reference."""
        layers = _layers()
        _feed(layers, [(1.0, 1.0, 1.0)] * 40)
        _feed(layers, [(1.0, 1.0, 0.0)] * (PATIENCE - 1))
        others = (0, 1)
        for _ in range(5):  # slot 2 has no gradient: a layout without it
            assert layers.observe(others, INV[:2], [10.0, 10.0], 1.0) == []
        l2, rms = _norms((1.0, 1.0, 0.0))
        reordered = (2, 0, 1)
        assert layers.observe(reordered, INV, [l2[2], l2[0], l2[1]], rms) == [2]

    def test_no_model_gradient_or_an_overflowed_norm_is_not_judged(self) -> None:
        """A zero or infinite model RMS says nothing about any share."""
        layers = _layers()
        _feed(layers, [(1.0, 1.0, 1.0)] * 40)
        for rms in (0.0, math.inf, math.nan):
            for _ in range(PATIENCE):
                assert layers.observe(SLOTS, INV, [0.0, 0.0, 0.0], rms) == []
        assert layers.threshold(2) == pytest.approx(RELATIVE)

    def test_new_thresholds_keep_the_history(self) -> None:
        """configure() changes the patience and the cap; the references stay."""
        layers = _layers()
        _feed(layers, [(1.0, 1.0, 1.0)] * 40)
        layers.configure(relative=1e-2, patience=2)
        assert layers.threshold(2) == pytest.approx(FALL)
        assert _feed(layers, [(1.0, 1.0, 5e-4)] * 3) == [(1, 2)]


# -- the event and its readers ---------------------------------------------------------------


def _dead_event() -> GradientVanished:
    return GradientVanished(step=9, mean_abs=None, threshold=1e-4, layers=("fc.weight",))


def test_a_dead_layer_event_without_mean_abs_reads_and_round_trips() -> None:
    """mean_abs None (dead layers only): one sentence naming the layers, the same after a log
    round trip, and the vanishing strategy describes it without comparing None."""
    event = _dead_event()
    assert (
        describe(event) == "1 layer(s) lost their gradient (RMS < 0.0001x the model's): fc.weight"
    )
    assert decode_event(encode_event(event)) == event
    decision = ReportVanishing().decide(event, StrategyHistory())
    assert decision is not None and "lost their gradient" in decision.reason


def test_an_old_log_line_with_a_nan_mean_abs_still_decodes() -> None:
    """Logs written before mean_abs could be None hold "NaN": decoded as a float nan."""
    line = encode_event(_dead_event()).replace(b'"mean_abs":null', b'"mean_abs":"NaN"')
    decoded = decode_event(line)
    assert isinstance(decoded, GradientVanished)
    assert decoded.mean_abs is not None and math.isnan(decoded.mean_abs)
    assert "mean |grad| nan" in describe(decoded)


# -- training runs ----------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models


class _Layer(nn.Module):
    """A BERT encoder layer: separate query/key/value with biases, post-LayerNorm."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(d, d) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = (
            p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for p in (self.query, self.key, self.value)
        )
        ctx = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        h = self.norm1(h + self.out(ctx))
        out: torch.Tensor = self.norm2(h + self.ffn(h))
        return out


class _Mlm(nn.Module):
    """A tiny masked LM initialized as Hugging Face does (normal weights, zero biases)."""

    def __init__(self, vocab: int = 100, d: int = 32, seq: int = 24, std: float = 0.015) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.norm = nn.LayerNorm(d)
        self.layers = nn.Sequential(_Layer(d, 4), _Layer(d, 4))
        self.head = nn.Linear(d, vocab)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))
        out: torch.Tensor = self.head(self.layers(h))
        return out


Step = Callable[[int], torch.Tensor]
"""One training step's forward and backward: the loss."""


def _run(model: nn.Module, step_fn: Step, steps: int, level: DebugLevel) -> list[Event]:
    sink = RecordingPublisher()
    probe = StepProbe(model, sink, level=level)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = step_fn(step)
        probe.check_step_sync(step, loss=loss)
        opt.step()
    probe.close()
    return list(sink.events)


def _mlm_steps(model: _Mlm, steps: int, *, dead_from: int | None = None) -> Step:
    """Random tokens, 15 % masked; from *dead_from* on, the first layer's FFN is cut off."""
    g = torch.Generator().manual_seed(7)
    data = torch.randint(5, 100, (steps, 8, 24), generator=g)
    mask = torch.rand(steps, 8, 24, generator=g) < 0.15
    first = model.layers[0]
    assert isinstance(first, _Layer)
    ffn = first.ffn

    def step_fn(step: int) -> torch.Tensor:
        if step == dead_from:
            ffn.register_forward_hook(lambda m, i, o: o * 0.0)
        ids = data[step].clone()
        labels = torch.where(mask[step], ids, torch.full_like(ids, -100))
        ids[mask[step]] = 4
        loss = F.cross_entropy(model(ids).reshape(-1, 100), labels.reshape(-1))
        torch.autograd.backward(loss)
        return loss.detach()

    return step_fn


def _shares(events: list[Event], numels: dict[str, int]) -> dict[str, list[float]]:
    """Each parameter's gradient RMS over the model's, per check (from ADVANCED telemetry)."""
    out: dict[str, list[float]] = {name: [] for name in numels}
    total_numel = sum(numels.values())
    for e in events:
        if isinstance(e, StepChecked) and e.grad_norm:
            rms = e.grad_norm / math.sqrt(total_numel)
            for name, norm in e.layer_grad_norms.items():
                out[name].append(norm / math.sqrt(numels[name]) / rms)
    return out


def test_a_transformer_at_hf_init_has_no_dead_layer() -> None:
    """Query/key shares crossing 1e-4 in and out (the old fixed floor's false alarms): none."""
    torch.manual_seed(7)
    model = _Mlm()
    steps = 150  # the old floor (a fixed 1e-4 of the model) reported two at steps 50 and 65
    events = _run(model, _mlm_steps(model, steps), steps, DebugLevel.ADVANCED)
    assert [e for e in events if isinstance(e, GradientVanished)] == []
    numels = {n: p.numel() for n, p in model.named_parameters()}
    shares = _shares(events, numels)
    crossings = [n for n, s in shares.items() if min(s) < RELATIVE < max(s) and min(s) > ALIVE]
    assert crossings, "the premise: some query/key share crosses vanishing_relative"


def test_a_transformer_layer_cut_off_mid_run_is_reported_within_the_patience() -> None:
    """The same model, its first FFN's output zeroed from step 40: its two Linear layers are
    named at step 40 + patience - 1, once, with mean_abs None and a relative threshold."""
    torch.manual_seed(7)
    model = _Mlm()
    steps, dead_from = 60, 40
    events = _run(model, _mlm_steps(model, steps, dead_from=dead_from), steps, DebugLevel.BASIC)
    (event,) = [e for e in events if isinstance(e, GradientVanished)]
    assert event.step == dead_from + PATIENCE - 1
    assert event.layers == tuple(
        f"layers.0.ffn.{i}.{p}" for i in (0, 2) for p in ("bias", "weight")
    )
    assert event.mean_abs is None and 0.0 < event.threshold <= RELATIVE
    assert not event.all_zero


def _hf_bert(steps: int) -> tuple[nn.Module, Step]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = transformers.BertForMaskedLM(config)
    model.train()
    g = torch.Generator().manual_seed(7)
    data = torch.randint(5, 100, (steps, 8, 24), generator=g)
    data[..., 1::2] = (data[..., 0::2] + 1).clamp(max=99)
    mask = torch.rand(steps, 8, 24, generator=g) < 0.15

    def step_fn(step: int) -> torch.Tensor:
        ids = data[step].clone()
        labels = torch.where(mask[step], ids, torch.full_like(ids, -100))
        ids[mask[step]] = 4
        loss: torch.Tensor = model(input_ids=ids, labels=labels).loss
        torch.autograd.backward(loss)
        return loss.detach()

    return model, step_fn


@pytest.mark.slow
@pytest.mark.parametrize("level", [DebugLevel.BASIC, DebugLevel.EXTREME])
def test_hugging_face_bert_trains_1500_steps_without_dead_layers(level: DebugLevel) -> None:
    """A tiny BertForMaskedLM from its config (HF's std-0.02 init): the old fixed floor saw 71
    dead layers in these 1,500 healthy steps; none now."""
    steps = 1500
    model, step_fn = _hf_bert(steps)
    events = _run(model, step_fn, steps, level)
    assert [e for e in events if isinstance(e, GradientVanished)] == []


@pytest.mark.slow
def test_hugging_face_bert_with_a_dead_ffn_is_reported_within_the_patience() -> None:
    """The same BERT, its first intermediate layer killed at step 300 (GELU of -1e4 = 0)."""
    steps, dead_at = 330, 300
    model, healthy = _hf_bert(steps)
    bert: Any = model  # a BertForMaskedLM
    dense = bert.bert.encoder.layer[0].intermediate.dense

    def step_fn(step: int) -> torch.Tensor:
        if step == dead_at:
            with torch.no_grad():
                dense.weight.zero_()
                dense.bias.fill_(-1e4)
        return healthy(step)

    events = _run(model, step_fn, steps, DebugLevel.BASIC)
    (event,) = [e for e in events if isinstance(e, GradientVanished)]
    assert event.step == dead_at + PATIENCE - 1
    assert "bert.encoder.layer.0.intermediate.dense.weight" in event.layers
    assert Thresholds().vanishing_patience == PATIENCE


def test_layers_frozen_mid_run_with_zeroed_grads_are_not_dead() -> None:
    """Freezing layers (requires_grad_(False)) under zero_grad(set_to_none=False) leaves their
    .grad a zero tensor: stale, not this step's gradient. They are not judged (never "dead"),
    and the total norm is the trainable parameters' alone."""
    torch.manual_seed(7)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    sink = RecordingPublisher()
    probe = StepProbe(model, sink)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    frozen = [*model[0].parameters(), *model[2].parameters()]
    norms: list[tuple[float | None, float]] = []
    for step in range(60):
        if step == 20:
            for p in frozen:
                p.requires_grad_(False)
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        torch.autograd.backward(loss)
        verdict = probe.check_step_sync(step, loss=loss)
        trainable = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        norms.append(
            (
                verdict.grad_norm,
                float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in trainable]))),
            )
        )
        opt.step()
    probe.close()
    assert all(p.grad is not None and not p.grad.any() for p in frozen)  # the premise
    assert [e for e in sink.events if isinstance(e, GradientVanished)] == []
    assert all(got == pytest.approx(want, rel=1e-5) for got, want in norms)
