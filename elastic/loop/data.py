"""Data pipelines whose position rides in the snapshot.

Two ways to feed a loop:

- **Addressed by step**: ``batch = get_batch(step)`` inside ``for step in run.steps``. Nothing is saved:
  a recomputed step asks for the same batch again.
- **An iterator with a position**: ``data = run.data(pipeline)`` (or ``for step, batch in
  run.batches(pipeline)``). The iterator must have ``get_state()`` and ``set_state(state)``
  (:class:`StatefulIterator`); Grain's ``DataLoader`` and ``IterDataset``/``MapDataset`` iterators do.

The contract of the second: every pass of the loop builds its own iterator (``iter(pipeline)``, or
``pipeline()`` for a function) and positions it with the state saved under its name in ``run.extras``
(``extras["data_positions"][name]``); with none saved it starts where the pipeline starts, which is only
allowed at step 0. Batches are pulled inside a step, before its commit; each ``run.commit`` records the
iterator's ``get_state()``, so the snapshot of step k holds the position right after the batches steps
0..k-1 consumed. A restore rolls the pipeline back with the model; a live reshard carries the position of
the last commit over (no rewind, no skip). A state is stored as plain data (``bytes`` as base64), so it
travels in every snapshot tier, the JSON one included.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from elastic.errors import ConfigError

__all__ = [
    "POSITIONS_KEY",
    "DataIterator",
    "StatefulIterator",
    "from_plain",
    "open_data",
    "record_positions",
    "to_plain",
]

POSITIONS_KEY = "data_positions"  # run.extras[POSITIONS_KEY][name]: the plain-data state of iterator `name`
_BYTES = "__bytes_b64__"

Source = Iterable[Any] | Callable[[], Iterator[Any]]


@runtime_checkable
class StatefulIterator(Protocol):
    """An iterator whose position can be read and set back: ``set_state(get_state())`` after k more
    ``next`` calls makes the next ``next`` return what followed those k elements."""

    def __next__(self) -> Any: ...

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


def to_plain(state: Any, where: str = "state") -> Any:
    """``state`` as JSON-safe plain data (``bytes`` tagged as base64, numpy scalars as Python scalars);
    ``ConfigError`` naming the first leaf that is not plain data."""
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    if isinstance(state, np.generic):
        return state.item()
    if isinstance(state, bytes):
        return {_BYTES: base64.b64encode(state).decode("ascii")}
    if isinstance(state, (list, tuple)):
        return type(state)(to_plain(v, f"{where}[{i}]") for i, v in enumerate(state))
    if isinstance(state, dict) and all(isinstance(k, str) for k in state):
        return {k: to_plain(v, f"{where}[{k!r}]") for k, v in state.items()}
    raise ConfigError(
        f"{where} is a {type(state).__name__}: an iterator's get_state() must return plain data "
        "(None, bool, int, float, str, bytes, and lists, tuples and str-keyed dicts of them) to be "
        "saved with the snapshot"
    )


def from_plain(plain: Any) -> Any:
    """The inverse of :func:`to_plain`."""
    if isinstance(plain, dict):
        if len(plain) == 1 and _BYTES in plain:
            return base64.b64decode(plain[_BYTES])
        return {k: from_plain(v) for k, v in plain.items()}
    if isinstance(plain, (list, tuple)):
        return type(plain)(from_plain(v) for v in plain)
    return plain


class DataIterator:
    """One pass's iterator over a pipeline. ``next(data)`` only inside a step, before its commit: a batch
    pulled between steps would be recorded as consumed by the previous step (``ConfigError``)."""

    def __init__(self, name: str, iterator: StatefulIterator, current_step: Callable[[], int | None]) -> None:
        self.name = name
        self.iterator = iterator
        self._current_step = current_step

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> Any:
        step = self._current_step()
        if step is None:
            raise ConfigError(
                f"next() on data {self.name!r} outside a step: pull a step's batches inside "
                "`for step in run.steps`, before that step's run.commit (never ahead of it)"
            )
        try:
            return next(self.iterator)
        except StopIteration as err:
            raise ConfigError(
                f"data {self.name!r} ran out at step {step}: the pipeline must yield a batch for "
                "every step up to num_steps (repeat it, e.g. num_epochs=None)"
            ) from err

    def position(self) -> Any:
        """The iterator's current state as plain data (what :func:`record_positions` stores)."""
        return to_plain(self.iterator.get_state(), where=f"data {self.name!r}: get_state()")


def _build(source: Source, name: str) -> Any:
    if isinstance(source, Iterator):
        raise ConfigError(
            f"data {name!r}: got an iterator ({type(source).__name__}); pass the pipeline itself "
            "(e.g. a grain DataLoader or IterDataset) or a function that builds a fresh iterator: "
            "every pass of the loop builds its own and positions it from the snapshot"
        )
    if isinstance(source, Iterable):
        return iter(source)
    if callable(source):
        return source()
    raise ConfigError(
        f"data {name!r}: {type(source).__name__} is neither iterable nor a function returning an iterator"
    )


def open_data(
    source: Source, *, name: str, extras: Mapping[str, Any], start_step: int, current_step: Callable[[], int | None]
) -> DataIterator:
    """Build ``source``'s iterator and position it at the state saved under ``name`` in ``extras``.

    Raises ``ConfigError`` when the iterator lacks ``get_state``/``set_state``, its state is not plain
    data, or no position was saved for it although the pass starts after step 0."""
    iterator = _build(source, name)
    if not isinstance(iterator, StatefulIterator):
        raise ConfigError(
            f"data {name!r}: {type(iterator).__name__} has no get_state() and set_state(state), so its position "
            "cannot be saved with the snapshot and restored with the model. Use an iterator that has them (grain's "
            "DataLoader and IterDataset iterators do; wrap another pipeline in a class whose get_state() returns "
            "the batches taken so far and whose set_state() rebuilds and skips ahead), or address the data by "
            "step: batch = get_batch(step) inside `for step in run.steps`"
        )
    saved = extras.get(POSITIONS_KEY, {}).get(name)
    if saved is not None:
        iterator.set_state(from_plain(saved))
    elif start_step > 0:
        raise ConfigError(
            f"data {name!r}: the snapshot of step {start_step} holds no position for it (saved: "
            f"{sorted(extras.get(POSITIONS_KEY, {}))}); open it with run.data in every pass, "
            "under the same name, from step 0"
        )
    data = DataIterator(name, iterator, current_step)
    data.position()  # a state that cannot be saved fails here, before the first step
    return data


def record_positions(extras: dict[str, Any], data: Mapping[str, DataIterator]) -> None:
    """Store every iterator's current position in ``extras`` (at each commit, before the snapshot)."""
    if data:
        extras.setdefault(POSITIONS_KEY, {}).update({name: d.position() for name, d in data.items()})
