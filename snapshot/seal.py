"""Sealed images: a MAC under the job's image key over everything an image restores, so that an image altered or
made by anyone without the key (another job holding the cluster token) is refused, not restored.

The MAC is keyed BLAKE3 over the image's layout (step, generation, each leaf's shape, dtype, key implementation
and piece regions), the pickled controller state, and every piece's bytes: the per-piece checksums (xxhash) catch
accidents, not an adversary who recomputes them. Sealing and checking read every byte once, on one thread (BLAKE3,
several times faster a core than keyed BLAKE2b), when an image is pushed to the keepers and on the restore
from a keeper. A MAC is tagged with its algorithm: an image sealed by another algorithm is refused, not misread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import pickle
from typing import Any

import blake3
import numpy as np

from .image import HostImage

__all__ = ["seal", "sealed"]


_TAG = "blake3:"


def _mac(image: HostImage, key: str) -> str:
    h = blake3.blake3(key=hashlib.sha256(key.encode()).digest())  # keyed mode: a 32-byte key, one thread
    layout = {
        "step": image.step,
        "generation": image.generation,
        "leaves": [
            {
                "shape": list(leaf.shape),
                "dtype": leaf.dtype,
                "key_impl": leaf.key_impl,
                "pieces": [[list(r) for r in p.index] for p in leaf.pieces],
            }
            for leaf in image.leaves
        ],
    }
    h.update(json.dumps(layout, sort_keys=True).encode())
    h.update(pickle.dumps(_canonical(image.meta), protocol=5))
    for leaf in image.leaves:
        for piece in leaf.pieces:
            h.update(np.ascontiguousarray(piece.data).view(np.uint8).reshape(-1).data)
    return _TAG + h.hexdigest()


def _canonical(value: Any) -> Any:
    """``value`` with arrays as (dtype, shape, bytes) and dicts in key order: the same bytes to pickle whether an
    array arrived writable or as a read-only view (their pickles differ)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, np.ascontiguousarray(value).tobytes())
    if isinstance(value, np.generic):
        return ("scalar", value.dtype.str, value.tobytes())
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _canonical(v)) for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_canonical(v) for v in value))
    return value


def seal(image: HostImage, key: str) -> HostImage:
    """``image`` carrying its MAC under ``key``."""
    return dataclasses.replace(image, mac=_mac(image, key))


def sealed(image: HostImage, key: str) -> bool:
    """True if ``image`` carries a MAC and it is right under ``key``."""
    return isinstance(image.mac, str) and hmac.compare_digest(image.mac.encode(), _mac(image, key).encode())
