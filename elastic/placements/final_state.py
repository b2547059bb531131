"""A multi-process job's final state, assembled in the driver from every worker's own regions
(``SliceWorker.final_pieces``): meant for checking small models; a large one is written by ``save_final_to``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from elastic.errors import ElasticError

__all__ = ["assemble_final"]


def assemble_final(got: dict[int, dict[str, Any]], members: Sequence[int], abstract: Any) -> Any:
    """The state of shape ``abstract`` as host arrays from the answers ``got`` (slice -> its pieces and the
    layout) of the final group's ``members`` (typed keys wrapped back). ``ElasticError`` when no member answered,
    or a region was held only by members that did not."""
    if not got:
        raise ElasticError(f"no worker of the final group {sorted(members)} answered for the final state")
    treedef = jax.tree_util.tree_structure(abstract)
    layout = next(iter(got.values()))["layout"]
    out = []
    for i, (shape, dtype, key_impl) in enumerate(layout):
        full = np.empty(tuple(shape), dtype=np.dtype(dtype))
        filled = np.zeros(tuple(shape), dtype=bool)
        for answer in got.values():
            for index, data in answer["pieces"][i]:
                where = tuple(slice(a, b) for a, b in index)
                full[where], filled[where] = data, True
        if not filled.all():
            gone = sorted(set(members) - set(got))
            raise ElasticError(
                f"the final state's leaf {i} is incomplete: slice(s) {gone} died after the last step and held "
                "the only copy of part of it (the job's last Orbax step, or save_final_to, has it whole)"
            )
        out.append(full if key_impl is None else jax.random.wrap_key_data(full, impl=key_impl))  # type: ignore[arg-type]  # host data
    return jax.tree_util.tree_unflatten(treedef, out)
