"""Host snapshots kept in files on the worker's node (tmpfs, ``/dev/shm``), so that they outlive its process.

A worker of a multi-controller job may die while its node lives on: SIGKILLed, or aborted by its collective
library as a peer dies. Its shards, and the buddy copies it held for a peer, would die with it, and when the peer
whose copies it held died too, the survivors no longer hold a whole step. A :class:`NodeStore` keeps each
generation as one ``.npy`` file per piece under ``<root>/slice-<s>/<kind>/step-<n>/`` (``kind``: ``own`` or
``buddy-<slice>``), written into a temporary directory and renamed when complete (a generation is there whole
or not at all). The process maps the files back (read-only) instead of keeping heap copies, so the node holds
one copy. A new process for the same slice on the same node (:meth:`load`) finds them and serves them to its
peers. The files are removed as generations are trimmed, and all of a job's at its end (:func:`remove_job`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from elastic.placements.mc_snapshots import Generation

__all__ = ["NodeStore", "default_root", "remove_job"]


def default_root(job: str) -> str:
    """Where a job's generations live on each node: tmpfs when there is one (memory, not disk)."""
    base = os.environ.get("ELASTIC_NODE_STORE") or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    return os.path.join(base, f"elastic-{job}")


def remove_job(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)


class NodeStore:
    """One slice's generations under ``root``; every method is bounded and raises ``OSError`` on a full or
    missing file system (the caller keeps the generation in its heap instead)."""

    def __init__(self, root: str, slice_index: int) -> None:
        self.dir = os.path.join(root, f"slice-{slice_index}")

    def _path(self, kind: str, step: int) -> str:
        return os.path.join(self.dir, kind, f"step-{step}")

    def put(self, kind: str, gen: Generation) -> Generation:
        """Write ``gen``; the same generation backed by the files (read-only maps), to hold instead."""
        final = self._path(kind, gen.step)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        work = tempfile.mkdtemp(prefix=f".step-{gen.step}-", dir=os.path.dirname(final))
        try:
            index = []
            for leaf, pieces in enumerate(gen.pieces):
                for k, (region, array) in enumerate(pieces.items()):
                    name = f"leaf{leaf}-{k}.npy"
                    np.save(os.path.join(work, name), np.ascontiguousarray(array), allow_pickle=False)
                    index.append({"leaf": leaf, "region": [list(b) for b in region], "file": name,
                                  "dtype": str(array.dtype), "shape": list(np.shape(array))})
            record = {"step": gen.step, "meta": gen.meta, "index": index, "leaves": len(gen.pieces),
                      "regions": [[[list(b) for b in r] for r in sorted(leaf)] for leaf in gen.regions]}
            with open(os.path.join(work, "generation.json"), "w") as f:
                json.dump(record, f)
            shutil.rmtree(final, ignore_errors=True)  # an older copy of the same step (a re-run pass)
            os.rename(work, final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return _read(final)

    def drop(self, kind: str, step: int) -> None:
        shutil.rmtree(self._path(kind, step), ignore_errors=True)

    def load(self) -> dict[str, dict[int, Generation]]:
        """Every complete generation here, by kind and step (what an earlier process for this slice left)."""
        found: dict[str, dict[int, Generation]] = {}
        if not os.path.isdir(self.dir):
            return found
        for kind in sorted(os.listdir(self.dir)):
            folder = os.path.join(self.dir, kind)
            for name in sorted(os.listdir(folder)):
                if name.startswith("step-"):  # complete ones only: temporaries start with "."
                    try:
                        gen = _read(os.path.join(folder, name))
                    except (OSError, ValueError, KeyError):
                        continue
                    found.setdefault(kind, {})[gen.step] = gen
        return found


def _region(bounds: list[list[int]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in bounds)


def _read(path: str) -> Generation:
    with open(os.path.join(path, "generation.json")) as f:
        record: dict[str, Any] = json.load(f)
    pieces: list[dict[Any, np.ndarray]] = [{} for _ in range(record["leaves"])]
    for item in record["index"]:
        array = np.load(os.path.join(path, item["file"]), mmap_mode="r")
        if str(array.dtype) != item["dtype"]:  # bfloat16 and other ml_dtypes are saved as raw void bytes
            array = array.view(np.dtype(item["dtype"]))
        if array.shape != tuple(item["shape"]):  # a 0-d array maps as shape (1,)
            array = array.reshape(item["shape"])
        pieces[item["leaf"]][_region(item["region"])] = array
    regions = [frozenset(_region(r) for r in leaf) for leaf in record["regions"]]
    return Generation(step=int(record["step"]), pieces=pieces, regions=regions, meta=record["meta"])
