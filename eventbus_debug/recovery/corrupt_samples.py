"""Corrupt samples: leave them out of the batch, report each one, stop when there are too many.

A sample that raises in ``dataset[i]`` becomes a small picklable :class:`CorruptSample` marker
(so it crosses data loader worker processes), the collate function drops the markers, and the
loader wrapper — running in the training process, where the bus is — publishes one
:class:`~eventbus_debug.recovery.SampleSkipped` per marker and enforces the bound::

    loader = skip_corrupt_samples(dataset, bus, max_skipped=10, batch_size=32, num_workers=2)
    for x, y in loader:
        ...

A batch that held a corrupt sample is one sample shorter; a batch whose samples all failed is
left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar, final

from torch.utils.data import DataLoader, Dataset, default_collate

from eventbus_debug.diagnostics import get_logger

from ..events import SampleSkipped
from ..exceptions import EventBusError
from ..step_context import StepSource, current_step
from ..typing import Publisher
from .classify import exception_names

__all__ = (
    "CollatedBatch",
    "CorruptDataError",
    "CorruptSample",
    "CorruptSampleCollate",
    "SkipCorruptSamples",
    "SkippingLoader",
    "skip_corrupt_samples",
)

_log = get_logger(__name__)

T = TypeVar("T")

SOURCE: Final = "recovery.data"  # the log's name, kept from before the rename
DEFAULT_MAX_SKIPPED: Final = 10
_MAX_MESSAGE: Final = 2000


class CorruptDataError(EventBusError, RuntimeError):
    """Raised by :class:`SkippingLoader` when a pass over the data skips more than allowed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CorruptSample:
    """Stands in for a sample whose loading raised (picklable: it crosses worker processes).

    Attributes:
        index: the sample's index in the dataset.
        error_type: the qualified class name of the exception.
        message: ``str(exception)`` (truncated to 2,000 characters).
    """

    index: int
    error_type: str
    message: str


@final
class SkipCorruptSamples(Dataset[Any], Generic[T]):
    """A map-style dataset whose failing samples come back as :class:`CorruptSample` markers.

    Use it with :class:`CorruptSampleCollate` and :class:`SkippingLoader` (or all three at once:
    :func:`skip_corrupt_samples`), which drop the markers and report them.

    Args:
        dataset: the map-style dataset (``__getitem__`` and ``__len__``).
        catch: the exception types that mark a sample corrupt; others propagate.

    Raises:
        TypeError: if *dataset* has no ``__getitem__`` or *catch* is empty or holds a
            non-exception.
    """

    def __init__(
        self, dataset: Dataset[T], *, catch: tuple[type[Exception], ...] = (Exception,)
    ) -> None:
        if not hasattr(dataset, "__getitem__"):
            msg = f"dataset must be a map-style dataset (with __getitem__), got {dataset!r}"
            raise TypeError(msg)
        if not catch or not all(isinstance(c, type) and issubclass(c, Exception) for c in catch):
            msg = f"catch must be a non-empty tuple of Exception subclasses, got {catch!r}"
            raise TypeError(msg)
        self.dataset = dataset
        self.catch = catch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> T | CorruptSample:
        try:
            return self.dataset[index]
        except self.catch as exc:
            return CorruptSample(
                index=int(index),
                error_type=exception_names(type(exc))[0],
                message=str(exc)[:_MAX_MESSAGE],
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class CollatedBatch:
    """What :class:`CorruptSampleCollate` returns: the batch and the markers left out of it.

    Attributes:
        batch: the collated good samples; ``None`` when every sample of the batch failed.
        corrupt: the markers of the samples left out.
    """

    batch: Any
    corrupt: tuple[CorruptSample, ...] = ()


@final
class CorruptSampleCollate:
    """A collate function that drops :class:`CorruptSample` markers before collating the rest.

    Args:
        collate_fn: the collate function for the good samples (``default_collate`` if ``None``).
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self.collate_fn = collate_fn if collate_fn is not None else default_collate

    def __call__(self, samples: Sequence[Any]) -> CollatedBatch:
        good = [s for s in samples if not isinstance(s, CorruptSample)]
        if len(good) == len(samples):
            return CollatedBatch(batch=self.collate_fn(list(samples)))
        corrupt = tuple(s for s in samples if isinstance(s, CorruptSample))
        return CollatedBatch(batch=self.collate_fn(good) if good else None, corrupt=corrupt)


@final
class SkippingLoader:
    """Iterates a loader built on :class:`CorruptSampleCollate`; reports and bounds the skips.

    For each marker it publishes a :class:`~eventbus_debug.recovery.SampleSkipped` incident
    (index, error) on *bus*, then yields the batch of the good samples.

    Args:
        loader: an iterable of :class:`CollatedBatch` (a ``DataLoader`` whose ``collate_fn`` is
            a :class:`CorruptSampleCollate`).
        bus: where the incidents go (``None``: only logged and counted).
        max_skipped: the most corrupt samples one pass may skip.
        step: returns the training step the incidents are stamped with; ``None`` (default):
            the step bound by the session iterating the loader
            (:func:`~eventbus_debug.step_context.current_step`), else no step. A batch is
            loaded before its step starts, so this is the step of the last completed batch
            (``None`` before the first).

    Raises:
        ValueError: if *max_skipped* < 0.
        TypeError: if *bus* is not a Publisher or ``None``, or *step* is not callable.
    """

    def __init__(
        self,
        loader: Any,
        bus: Publisher | None,
        *,
        max_skipped: int = DEFAULT_MAX_SKIPPED,
        step: StepSource | None = None,
    ) -> None:
        if isinstance(max_skipped, bool) or not isinstance(max_skipped, int) or max_skipped < 0:
            msg = f"max_skipped must be an integer >= 0 (corrupt samples per pass), got {max_skipped!r}"
            raise ValueError(msg)
        if bus is not None and not isinstance(bus, Publisher):
            msg = f"bus must be a Publisher (an EventBus, a SyncEventBus...) or None, got {bus!r}"
            raise TypeError(msg)
        if step is not None and not callable(step):
            msg = f"step must be a callable returning the current step, or None, got {step!r}"
            raise TypeError(msg)
        self.step = step
        self.loader = loader
        self.bus = bus
        self.max_skipped = max_skipped
        self.skipped: list[CorruptSample] = []
        """The samples skipped in the current (or last) pass."""

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        """Yield the batches of one pass.

        Raises:
            CorruptDataError: when more than *max_skipped* samples failed in this pass.
            TypeError: if the loader yields something other than :class:`CollatedBatch`.
        """
        self.skipped = []
        for item in self.loader:
            if not isinstance(item, CollatedBatch):
                msg = (
                    f"the loader yielded {type(item).__name__}, not a CollatedBatch: build it with "
                    "collate_fn=CorruptSampleCollate(...) (or use skip_corrupt_samples())"
                )
                raise TypeError(msg)
            for corrupt in item.corrupt:
                self._report(corrupt)
            if item.batch is not None:
                yield item.batch

    def _report(self, corrupt: CorruptSample) -> None:
        self.skipped.append(corrupt)
        count = len(self.skipped)
        _log.warning(
            "sample_skipped", index=corrupt.index, error=f"{corrupt.error_type}: {corrupt.message}"
        )
        event = SampleSkipped(
            step=current_step(self.step),
            source=SOURCE,
            index=corrupt.index,
            error_type=corrupt.error_type,
            message=corrupt.message,
            skipped=count,
            max_skipped=self.max_skipped,
        )
        if self.bus is not None:
            self.bus.publish_nowait(event)
        if count > self.max_skipped:
            indices = ", ".join(str(c.index) for c in self.skipped[:20])
            msg = (
                f"{count} corrupt samples in one pass, more than max_skipped={self.max_skipped} "
                f"(indices {indices}); last error: {corrupt.error_type}: {corrupt.message}. "
                "Fix the data or raise max_skipped"
            )
            raise CorruptDataError(msg)


def skip_corrupt_samples(
    dataset: Dataset[T],
    bus: Publisher | None,
    *,
    max_skipped: int = DEFAULT_MAX_SKIPPED,
    catch: tuple[type[Exception], ...] = (Exception,),
    collate_fn: Callable[[list[Any]], Any] | None = None,
    step: StepSource | None = None,
    **loader_kwargs: Any,
) -> SkippingLoader:
    """A ``DataLoader`` over *dataset* that skips and reports samples that raise.

    *loader_kwargs* go to ``torch.utils.data.DataLoader`` (``batch_size``, ``shuffle``,
    ``num_workers``, ...); *collate_fn* collates the good samples; *step* is as for
    :class:`SkippingLoader`.

    Raises:
        TypeError, ValueError: as :class:`SkipCorruptSamples` and :class:`SkippingLoader`, or
            as ``DataLoader`` for a bad *loader_kwargs*.
    """
    loader = DataLoader(
        SkipCorruptSamples(dataset, catch=catch),
        collate_fn=CorruptSampleCollate(collate_fn),
        **loader_kwargs,
    )
    return SkippingLoader(loader, bus, max_skipped=max_skipped, step=step)
