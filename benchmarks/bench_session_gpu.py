"""The GPU table of issue #13: what the probe and the session cost per step on a CUDA device.

Two workloads, each variant a ratio to the bare loop measured in the same run:

- W1: MLP 784-512-512-10, batch 64, AdamW;
- GPT-2 small (124 M) built from ``transformers.GPT2Config()`` (no download), batch 8 x 512
  tokens, bf16 autocast, AdamW; a same-shape plain PyTorch decoder when ``transformers`` is
  not installed.

Variants: ``bare`` (AdamW, torch's default implementation), ``probe`` (a ``StepProbe`` checking
every step, its verdict read at once), ``deferred`` (the probe read a step later), ``session``
(the full default ``Session``: log, report, alerts, system sampler; its last good state kept
beside the model, as ``StateSnapshots(location="auto")`` does for these sizes on a large GPU),
``session host`` (the same with the snapshot in pinned host memory, ``location="host"``, as
"auto" does for a model over 5 % of the device), ``seed .item()`` (W1 only:
one ``.item()`` per parameter, the seed's way); then, against ``bare fused``
(``AdamW(fused=True)``), ``session fused`` and ``device_skip`` (``Session(...,
device_skip=True)``: a non-finite step is skipped by the fused optimizer on the device, no host
synchronization). The last lines compare the host time per step with and without device_skip.

Timing: warm-up steps first, then rounds in which the variants take turns (interleaved), each
timing a block of steps between two CUDA events with ``torch.cuda.synchronize()`` around it;
the median over rounds is reported. ``host us`` is the host time spent per step inside the
probe's or the session's calls (``time.perf_counter``, no synchronization). ``launches`` is the
number of CUDA kernel launches per step seen by ``torch.profiler`` (``--profile``).

Without CUDA the script says so and exits 0 (CI has no GPU). ``--device cpu`` runs the same
code on the CPU with tiny sizes: a dry run, whose figures mean nothing (``--full`` keeps the
real sizes: the CPU's own figures).

Run: python benchmarks/bench_session_gpu.py [--steps 50] [--warmup 10] [--rounds 5] [--profile]
     [--only w1|gpt2] [--device cuda|cpu] [--full]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.lowlevel
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eventbus_debug import EventBus, Session, StepProbe
from eventbus_debug.recovery import StateSnapshots

NO_CUDA: Final = (
    "CUDA is not available: bench_session_gpu.py measures GPU overheads, nothing to run "
    "(--device cpu runs the same code with tiny sizes, as a dry run)"
)

BARE: Final = "bare"
BARE_FUSED: Final = "bare fused"


@dataclass(frozen=True, slots=True)
class Variant:
    """One way of running the step: its name, its baseline, and how it checks the step."""

    name: str
    kind: str  # bare | probe | deferred | session | session_host | seed | device_skip
    fused: bool = False

    @property
    def baseline(self) -> str:
        return BARE_FUSED if self.fused else BARE


VARIANTS: Final = (
    Variant(BARE, "bare"),
    Variant("probe", "probe"),
    Variant("deferred", "deferred"),
    Variant("session", "session"),
    Variant("session host", "session_host"),
    Variant("seed .item()", "seed"),
    Variant(BARE_FUSED, "bare", fused=True),
    Variant("session fused", "session", fused=True),
    Variant("device_skip", "device_skip", fused=True),
)


@dataclass(slots=True)
class Workload:
    """A model, its batch and its loss, built on a device."""

    name: str
    model: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    autocast: torch.dtype | None = None
    seed_style: bool = True
    note: str = ""


def w1(device: torch.device, *, tiny: bool) -> Workload:
    """MLP 784-512-512-10, batch 64 (tiny: 784-32-32-10, batch 8)."""
    width, batch = (32, 8) if tiny else (512, 64)

    def model() -> nn.Module:
        return nn.Sequential(
            nn.Linear(784, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 10),
        )

    def make(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch, 784, generator=gen).to(device)
        return x, torch.randint(0, 10, (batch,), generator=gen).to(device)

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = nn.functional.cross_entropy(m(x), y)
        return out

    return Workload(f"W1 MLP 784-{width}-{width}-10 batch {batch}", model, make, loss)


class _Decoder(nn.Module):
    """A GPT-2-shaped decoder in plain PyTorch (pre-norm blocks, tied head, causal mask)."""

    def __init__(self, vocab: int, positions: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(positions, width)
        block = nn.TransformerEncoderLayer(
            width,
            heads,
            4 * width,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device)
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        h = self.blocks(self.tokens(ids) + self.positions(pos), mask=mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


def gpt2(device: torch.device, *, tiny: bool) -> Workload:
    """GPT-2 small from its config (no download), batch 8 x 512, bf16 autocast."""
    sizes = dict(vocab=50257, positions=1024, width=768, layers=12, heads=12)
    batch, seq = 8, 512
    if tiny:
        sizes = dict(vocab=256, positions=64, width=32, layers=2, heads=2)
        batch, seq = 2, 16
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging
    except ImportError:
        hf = False
    else:
        hf = True
        hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # a script: its own output stays the table

    def model() -> nn.Module:
        if hf:
            config = GPT2Config(
                vocab_size=sizes["vocab"],
                n_positions=sizes["positions"],
                n_embd=sizes["width"],
                n_layer=sizes["layers"],
                n_head=sizes["heads"],
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=sizes["vocab"] - 1,
                eos_token_id=sizes["vocab"] - 1,
            )
            hf_model: nn.Module = GPT2LMHeadModel(config)
            return hf_model
        return _Decoder(**sizes)

    def make(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, sizes["vocab"], (batch, seq), generator=gen).to(device)
        return ids, ids

    def loss(m: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if hf:
            out: torch.Tensor = m(input_ids=ids, labels=labels).loss
            return out
        logits = m(ids)[:, :-1]
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())

    label = "GPT-2 small (transformers GPT2Config)" if hf else "GPT-2-shaped plain decoder"
    name = f"{label} {'tiny ' if tiny else ''}batch {batch}x{seq} bf16 autocast"
    return Workload(name, model, make, loss, autocast=torch.bfloat16, seed_style=False)


WORKLOADS: Final = {"w1": w1, "gpt2": gpt2}


@dataclass(slots=True)
class Runner:
    """One variant's model, optimizer and instruments, stepped round after round."""

    variant: Variant
    workload: Workload
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, torch.Tensor]
    probe: StepProbe | None = None
    session: Session | None = None
    step_no: int = 0
    host_s: float = 0.0
    host_calls: int = 0
    times: list[float] = field(default_factory=list)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self.workload.autocast
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    async def step(self) -> None:
        """One training step, checked the variant's way."""
        model, opt = self.model, self.optimizer
        step = self.step_no
        self.step_no += 1
        opt.zero_grad(set_to_none=True)
        with self._autocast():
            loss = self.workload.loss(model, *self.batch)
        torch.autograd.backward(loss)
        kind = self.variant.kind
        if kind == "bare":
            opt.step()
            await anyio.lowlevel.checkpoint()
            return
        if kind == "seed":
            t0 = time.perf_counter()
            finite = all(
                torch.isfinite(p.grad.norm()).item()
                for p in model.parameters()
                if p.grad is not None
            )
            self._host(t0)
            if finite:
                opt.step()
            await anyio.lowlevel.checkpoint()
            return
        if self.probe is not None:
            t0 = time.perf_counter()
            verdict = await self.probe.check_step(step, loss=loss)
            self._host(t0)
            if verdict.finite:
                opt.step()
            return
        session = self.session
        assert session is not None
        t0 = time.perf_counter()
        checked = await session.check_step(step, loss=loss)
        host = time.perf_counter() - t0
        if checked.should_step:
            opt.step()
        t1 = time.perf_counter()
        await session.step_completed(
            step, loss=checked.loss if checked.probe.step == step else None
        )
        self.host_s += host + time.perf_counter() - t1
        self.host_calls += 1

    def _host(self, t0: float) -> None:
        self.host_s += time.perf_counter() - t0
        self.host_calls += 1

    @property
    def host_us(self) -> float | None:
        """Host time per step inside the probe's or the session's calls (None: bare)."""
        return self.host_s / self.host_calls * 1e6 if self.host_calls else None


async def _runner(
    variant: Variant,
    workload: Workload,
    device: torch.device,
    stack: contextlib.AsyncExitStack,
    bus: EventBus,
    log_root: Path,
) -> Runner:
    torch.manual_seed(0)
    model = workload.model().to(device)
    opt_kw: dict[str, Any] = {"lr": 1e-4}
    if variant.fused:
        opt_kw["fused"] = True
    optimizer = torch.optim.AdamW(model.parameters(), **opt_kw)
    batch = workload.batch(torch.Generator().manual_seed(1))
    runner = Runner(variant, workload, device, model, optimizer, batch)
    if variant.kind in ("probe", "deferred"):
        runner.probe = StepProbe(model, bus, deferred=variant.kind == "deferred")
        stack.callback(runner.probe.close)
    elif variant.kind in ("session", "session_host", "device_skip"):
        log_dir = log_root / variant.name.replace(" ", "_")
        snapshots = StateSnapshots(location="host") if variant.kind == "session_host" else None
        runner.session = await stack.enter_async_context(
            Session(
                model,
                optimizer,
                log_dir=log_dir,
                device_skip=variant.kind == "device_skip",
                snapshots=snapshots,
            )
        )
    return runner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # pragma: no cover - GPU
        torch.cuda.synchronize(device)


async def _timed(runner: Runner, steps: int) -> float:
    """Seconds per step of *steps* steps (CUDA events on a GPU, the wall clock on a CPU)."""
    device = runner.device
    _sync(device)
    if device.type == "cuda":  # pragma: no cover - GPU
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(steps):
            await runner.step()
        end.record()
        _sync(device)
        return float(start.elapsed_time(end)) / 1e3 / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        await runner.step()
    return (time.perf_counter() - t0) / steps


async def _launches(runner: Runner, steps: int) -> float:
    """CUDA kernel launches per step, counted by torch.profiler over *steps* steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":  # pragma: no cover - GPU
        activities.append(ProfilerActivity.CUDA)
    _sync(runner.device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            await runner.step()
        _sync(runner.device)
    launches: int = sum(e.count for e in prof.key_averages() if "LaunchKernel" in e.key)
    return launches / steps


@dataclass(frozen=True, slots=True)
class Row:
    """One variant's figures."""

    name: str
    baseline: str
    ms: float
    ratio: float
    host_us: float | None
    launches: float | None


async def measure(
    workload: Workload,
    device: torch.device,
    *,
    steps: int,
    warmup: int,
    rounds: int,
    profile_steps: int,
) -> list[Row]:
    """Every variant of *workload*, interleaved over *rounds*; ratios to their baselines."""
    variants = [v for v in VARIANTS if v.kind != "seed" or workload.seed_style]
    async with contextlib.AsyncExitStack() as stack:
        bus = await stack.enter_async_context(EventBus())
        log_root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        runners = [await _runner(v, workload, device, stack, bus, log_root) for v in variants]
        for runner in runners:
            for _ in range(warmup):
                await runner.step()
            runner.host_s, runner.host_calls = 0.0, 0
        for _ in range(rounds):
            for runner in runners:
                runner.times.append(await _timed(runner, steps))
        launches = {
            r.variant.name: await _launches(r, profile_steps) if profile_steps else None
            for r in runners
        }
    medians = {r.variant.name: statistics.median(r.times) for r in runners}
    return [
        Row(
            name=r.variant.name,
            baseline=r.variant.baseline,
            ms=medians[r.variant.name] * 1e3,
            ratio=medians[r.variant.name] / medians[r.variant.baseline],
            host_us=r.host_us,
            launches=launches[r.variant.name],
        )
        for r in runners
    ]


def render(title: str, rows: Sequence[Row]) -> str:
    """The table of one workload, and the device_skip comparison under it."""
    lines = [
        title,
        f"  {'variant':<14} {'ms/step':>9} {'ratio':>7}  {'vs':<10} {'host us':>8} {'launches':>9}",
    ]
    for r in rows:
        host = f"{r.host_us:8.0f}" if r.host_us is not None else f"{'-':>8}"
        launches = f"{r.launches:9.1f}" if r.launches is not None else f"{'-':>9}"
        lines.append(
            f"  {r.name:<14} {r.ms:9.3f} {r.ratio:6.2f}x  {r.baseline:<10} {host} {launches}"
        )
    by = {r.name: r for r in rows}
    beside, in_host = by.get("session"), by.get("session host")
    if beside is not None and in_host is not None:
        lines.append(
            f"  snapshot in host memory: step time {in_host.ms / beside.ms:.3f}x the session's "
            "with it beside the model (a copy every 50 good steps)"
        )
    plain, skip = by.get("session fused"), by.get("device_skip")
    if plain is not None and skip is not None and plain.host_us and skip.host_us:
        lines.append(
            f"  device_skip: session host time {skip.host_us:.0f} us/step vs {plain.host_us:.0f} "
            f"without ({skip.host_us / plain.host_us:.2f}x); step time {skip.ms / plain.ms:.2f}x"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the table; 0 also when there is no CUDA device (the script then says so)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=sorted(WORKLOADS), default=None)
    parser.add_argument("--profile", action="store_true", help="count kernel launches per step")
    parser.add_argument("--full", action="store_true", help="on the CPU too, the GPU sizes")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    device = torch.device(args.device)
    tiny = device.type == "cpu" and not args.full
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared CPU: no thread oversubscription
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    where += " (dry run, tiny sizes)" if tiny else ""
    print(f"device: {where}; torch {torch.__version__}; {args.rounds} rounds x {args.steps} steps")
    for key, build in WORKLOADS.items():
        if args.only is not None and key != args.only:
            continue
        workload = build(device, tiny=tiny)
        run = functools.partial(
            measure,
            workload,
            device,
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds,
            profile_steps=min(args.steps, 5) if args.profile else 0,
        )
        rows = anyio.run(run)
        print(render(workload.name, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
