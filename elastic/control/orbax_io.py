"""Orbax interop: start a job from an existing Orbax checkpoint, and write one of the final state.

``ElasticJob(init_from=path)``: the state at step 0 is read from ``path`` instead of ``init_fn(key)``
(``init_fn`` still defines the state's structure). ``path`` is any of what Orbax writes:

- a pytree checkpoint (``ocp.StandardCheckpointer().save(path, state)``, or ``PyTreeCheckpointer``);
- a ``CheckpointManager`` step directory (``root/5000``) holding one item (``default``, ``state``, or any
  single name) that is such a checkpoint;
- a ``CheckpointManager`` root: its newest step.

The checkpoint's tree (paths, shapes, dtypes) is checked against ``init_fn``'s at construction: a mismatch is
a ``ConfigError`` listing the differences, before anything starts. It is restored straight onto the mesh's
shardings (any mesh). A checkpoint whose step its layout gives (a ``CheckpointManager``'s ``root/S``) is continued
at step S: ``run.steps`` starts there, steps 0..S-1 count as done in the ledger (each with its own batch) and
the report says ``extra["continued_from_step"]``; ``num_steps`` is the run's total, as for the run that wrote the
checkpoint. A checkpoint with no step in its path starts at step 0.

``ElasticJob(save_final_to=path)``: after the last step, the final state is written to ``path`` with
``ocp.StandardCheckpointer``, readable without this package. ``path`` must not exist yet (nothing already
saved is overwritten), checked at construction.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from elastic.errors import ConfigError

__all__ = ["checkpoint_step", "check_new_directory", "resolve", "restore_onto", "save_final", "check_matches"]

_ITEM_NAMES = ("default", "state")  # the item names CheckpointManager users usually give the train state


def _is_pytree_checkpoint(path: epath.Path) -> bool:
    return path.is_dir() and (
        (path / "_METADATA").exists() or (path / "_CHECKPOINT_METADATA").exists() and (path / "manifest.ocdbt").exists()
    )


def _steps(path: epath.Path) -> list[int]:
    return sorted(int(p.name) for p in path.iterdir() if p.is_dir() and p.name.isdigit())


def resolve(path: str | os.PathLike) -> tuple[epath.Path, int | None]:
    """The pytree checkpoint directory ``path`` names, and its step where the layout says (a manager's)."""
    root = epath.Path(path)
    if not root.is_dir():
        raise ConfigError(f"init_from={str(path)!r} is not a directory: give an Orbax checkpoint directory")
    if _is_pytree_checkpoint(root):
        return root, int(root.name) if root.name.isdigit() else None
    step: int | None = None
    if not root.name.isdigit():
        steps = _steps(root)
        if steps:
            step, root = steps[-1], root / str(steps[-1])
    elif root.name.isdigit():
        step = int(root.name)
    if _is_pytree_checkpoint(root):
        return root, step
    items = [p for p in root.iterdir() if p.is_dir() and _is_pytree_checkpoint(p)]
    named = [p for p in items if p.name in _ITEM_NAMES]
    if len(named) == 1 or len(items) == 1:
        return (named or items)[0], step
    found = sorted(p.name for p in items)
    raise ConfigError(
        f"init_from={str(path)!r}: no single Orbax pytree checkpoint there (items: {found or 'none'}); "
        "point at the item's directory itself, e.g. <root>/<step>/<item>"
    )


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of the checkpoint ``path`` names, where its directory layout says (a CheckpointManager's)."""
    return resolve(path)[1]


def _name(path: tuple[Any, ...]) -> str:
    """A leaf's path as Orbax and jax both spell it: ``opt/0/mu/w1`` (a named tuple's field, a list index and a
    dict key alike)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _layout(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    return {
        _name(p): (tuple(x.shape), str(x.dtype))
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if hasattr(x, "shape")
    }


def check_matches(path: epath.Path, abstract: Any) -> None:
    """``ConfigError`` listing how the checkpoint's tree differs from ``abstract`` (paths, shapes, dtypes)."""
    try:
        saved_tree = ocp.StandardCheckpointer().metadata(path).item_metadata.tree
    except Exception as err:
        raise ConfigError(f"cannot read the Orbax checkpoint at {path}: {type(err).__name__}: {err}") from err
    saved = _layout(saved_tree)
    wanted = _layout(jax.tree_util.tree_map(_plain_dtype, abstract))
    problems = [f"{k}: missing from the checkpoint" for k in sorted(wanted.keys() - saved.keys())]
    problems += [f"{k}: in the checkpoint, not in init_fn's state" for k in sorted(saved.keys() - wanted.keys())]
    problems += [
        f"{k}: checkpoint {saved[k][0]} {saved[k][1]}, state {wanted[k][0]} {wanted[k][1]}"
        for k in sorted(saved.keys() & wanted.keys())
        if saved[k] != wanted[k]
    ]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ConfigError(f"the Orbax checkpoint at {path} does not match init_fn's state: {shown}")


def _plain_dtype(x: Any) -> Any:
    """A typed PRNG key's leaf as Orbax describes it (its key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.eval_shape(jax.random.key_data, x)
    return x


def restore_onto(path: epath.Path, abstract: Any, shardings: Any) -> Any:
    """The checkpoint's state, placed on ``shardings`` (one per leaf of ``abstract``)."""
    target = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
    )
    return ocp.StandardCheckpointer().restore(path, target)


def check_new_directory(path: str | os.PathLike) -> epath.Path:
    """``path`` as a directory a final checkpoint may be written to: it must not exist, its parent must."""
    target = epath.Path(path)
    if target.exists():
        raise ConfigError(f"save_final_to={str(path)!r} exists: choose a new directory (nothing saved is overwritten)")
    if not target.parent.is_dir():
        raise ConfigError(f"save_final_to={str(path)!r}: its parent directory {str(target.parent)!r} does not exist")
    return target


def save_final(path: epath.Path, state: Any) -> None:
    """Write ``state`` with ``ocp.StandardCheckpointer`` and wait until it is durable."""
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
