"""One-line integrations with the training frameworks people already use.

Each framework has its own module, imported on demand (the frameworks are optional extras,
never dependencies of ``eventbus_debug`` itself)::

    from eventbus_debug.integrations.lightning import EventBusDebugCallback     # [lightning]
    from eventbus_debug.integrations.transformers import EventBusDebugCallback  # [transformers]
    from eventbus_debug.integrations.ignite import EventBusDebugHandler         # [ignite]

Every integration runs a :class:`~eventbus_debug.SyncSession` for the fit, checks the
gradients **before** the framework clips them and before the optimizer steps, skips a step the
session says to skip (the gradients are set to ``None``, so the framework's own
``optimizer.step()`` call leaves the parameters and the optimizer state untouched), and hands
the framework's LR schedulers and AMP ``GradScaler`` to the session. See docs/integrations.md.
"""

from __future__ import annotations

__all__: tuple[str, ...] = ()
