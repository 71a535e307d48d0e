"""Seed 002's use case: debugging a (tiny) diffusion model for ad images.

A small UNet-like denoiser and a linear noise schedule are built here (no downloads). The
pipeline's components are analyzed (parameter counts, dtypes, devices), the denoiser is trained
for a few steps under the session, then sampling monitors every denoising step's latents for
non-finite values and norm drift. A deliberately broken sampler step shows the incidents.

Run: python examples/ads_diffusion_debugging.py
"""

from __future__ import annotations

import anyio
import torch
from torch import nn

from eventbus_debug import Session
from eventbus_debug.events import LatentAnomalyDetected
from eventbus_debug.extras import LatentMonitor, analyze_pipeline
from eventbus_debug.testing import RecordingSink


class TinyUNet(nn.Module):
    """Down, middle, up, with a skip connection and a timestep embedding."""

    def __init__(self, channels: int = 4, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(1, width), nn.SiLU())
        self.down = nn.Conv2d(channels, width, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(width, width, 3, padding=1)
        self.up = nn.ConvTranspose2d(width, width, 4, stride=2, padding=1)
        self.out = nn.Conv2d(width + channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = nn.functional.silu(self.down(x))
        h = nn.functional.silu(self.mid(h) + self.embed(t.view(-1, 1).float())[:, :, None, None])
        h = nn.functional.silu(self.up(h))
        return self.out(torch.cat([h, x], dim=1))


class TinyPipeline:
    """What a diffusers pipeline holds: a denoiser, a text encoder, a schedule."""

    def __init__(self, timesteps: int) -> None:
        self.unet = TinyUNet()
        self.text_encoder = nn.Embedding(100, 16)
        self.betas = torch.linspace(1e-4, 0.02, timesteps)
        self.alphas_cumprod = torch.cumprod(1 - self.betas, dim=0)


async def main(train_steps: int = 60, timesteps: int = 50, size: int = 16) -> dict[str, int]:
    """Analyze, train and sample; return the incidents the latent monitor raised."""
    torch.manual_seed(0)
    pipe = TinyPipeline(timesteps)
    optimizer = torch.optim.Adam(pipe.unet.parameters(), lr=1e-3)
    recorder = RecordingSink()
    async with Session(
        pipe.unet, optimizer, log_dir=None, report=False, sinks=[recorder], name="ads"
    ) as session:
        analysis = analyze_pipeline(pipe)
        session.publish(analysis)
        for c in analysis.components:
            print(f"{c.name:>13}: {c.parameters:>6} parameters {c.dtypes} on {c.devices}")
        # training: predict the noise added at a random timestep
        for step in range(train_steps):
            x0 = torch.tanh(torch.randn(8, 4, size, size))
            t = torch.randint(0, timesteps, (8,))
            noise = torch.randn_like(x0)
            a = pipe.alphas_cumprod[t].view(-1, 1, 1, 1)
            xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(pipe.unet(xt, t), noise)
            torch.autograd.backward(loss)
            if (await session.check_step(step, loss=loss)).should_step:
                optimizer.step()
            await session.step_completed(step, loss=loss)
        # sampling (DDIM-like, deterministic), monitored per denoising step
        monitor = LatentMonitor(max_norm_ratio=3.0)
        for run, broken in enumerate((False, True)):
            monitor.reset()
            latents = torch.randn(1, 4, size, size)
            with torch.no_grad():
                for i, t in enumerate(reversed(range(timesteps))):
                    tt = torch.tensor([t])
                    eps = pipe.unet(latents, tt)
                    a = pipe.alphas_cumprod[t]
                    a_prev = pipe.alphas_cumprod[t - 1] if t > 0 else torch.tensor(1.0)
                    x0 = (latents - (1 - a).sqrt() * eps) / a.sqrt()
                    if broken and i == timesteps // 2:
                        x0 = x0 * 50  # a bad guidance scale
                    latents = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
                    await monitor.check(
                        latents, denoising_step=i, timestep=t, publish=session.publish, step=run
                    )
        await session.bus.drain()
    incidents = recorder.of_type(LatentAnomalyDetected)
    for inc in incidents:
        print(f"sample {inc.step}: {inc.message}")
    return {"incidents": len(incidents), "components": len(analysis.components)}


if __name__ == "__main__":
    anyio.run(main)
