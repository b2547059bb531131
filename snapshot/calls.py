"""Signed calls: a caller proves it holds a credential without sending it, and each proof works once.

A job's actors (supervisor, agents, workers, keepers, standby helpers) answer only calls that carry ``token=``
signed under a *call key* derived from the credential of their kind (:func:`call_key`). The token of one call is
``c1.<milliseconds>.<nonce>.<mac>``: an HMAC-SHA256 under the call key over the method's name, the time and a
fresh random nonce (:func:`sign`). The actor (:class:`CallCheck`) accepts it only

- for the method it was signed for (a token taken from one call does not open another method);
- within :data:`WINDOW_S` of its time (clocks of a cluster's hosts agree to far better than that);
- once: a nonce seen within the window is refused as a *replay*.

So the credential itself never travels with a call, an actor never holds more than the call key of its own kind,
and a call seen in flight (or a token left in a log) cannot be used again. :class:`Signed` wraps an actor handle
so that every ``handle.method.remote(...)`` carries a fresh token; it pickles with the call key only.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import deque
from typing import Any, cast

__all__ = ["WINDOW_S", "CallCheck", "Signed", "call_key", "derive", "sign"]

WINDOW_S = 300.0  # a token is good this long either side of its time, and its nonce remembered as long
_TOKEN = re.compile(r"c1\.(\d{1,16})\.([0-9a-f]{32})\.([0-9a-f]{64})")


def derive(secret: str, label: str) -> str:
    """The credential for one use (``agent``, ``keeper``, ``stream``, ``image``, ``call``) of ``secret``."""
    return hmac.new(secret.encode(), label.encode(), hashlib.sha256).hexdigest()


def call_key(credential: str) -> str:
    """The key that signs (and checks) calls made with ``credential``; it does not give the credential back."""
    return derive(credential, "call")


def _mac(key: str, method: str, ms: str, nonce: str) -> str:
    return hmac.new(key.encode(), f"{method}\0{ms}\0{nonce}".encode(), hashlib.sha256).hexdigest()


def sign(key: str, method: str) -> str:
    """A token for one call of ``method`` under the call key ``key``."""
    ms, nonce = str(int(time.time() * 1000)), secrets.token_hex(16)
    return f"c1.{ms}.{nonce}.{_mac(key, method, ms, nonce)}"


class CallCheck:
    """What one actor remembers to check its calls: its call keys (a key None is open: every call passes) and the
    nonces it accepted within the window. Thread-safe."""

    def __init__(self, *keys: str | None) -> None:
        self.keys = keys
        self._seen: set[str] = set()
        self._order: deque[tuple[float, str]] = deque()  # (when to forget, nonce), oldest first
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        return any(k is None for k in self.keys)

    def refusal(self, token: object, method: str, *, keys: tuple[int, ...] | None = None) -> str | None:
        """None if ``token`` is a fresh call of ``method`` signed under one of the keys (``keys``: their indexes
        that this method accepts; default all); else why not, in a few words. A token accepted is spent."""
        chosen = [self.keys[i] for i in (keys if keys is not None else range(len(self.keys)))]
        if any(k is None for k in chosen):
            return None
        if not isinstance(token, str) or (found := _TOKEN.fullmatch(token)) is None:
            return "no signed credential"
        ms, nonce, mac = found.groups()
        if not any(k is not None and hmac.compare_digest(mac, _mac(k, method, ms, nonce)) for k in chosen):
            return "not signed with this job's credential for this method"
        now = time.time()
        if abs(now - int(ms) / 1000) > WINDOW_S:
            return f"signed more than {WINDOW_S:.0f} s away from now (an old call replayed, or a clock far off)"
        with self._lock:
            while self._order and self._order[0][0] < now:
                self._seen.discard(self._order.popleft()[1])
            if nonce in self._seen:
                return "a replayed call (its token was used already)"
            self._seen.add(nonce)
            self._order.append((now + 2 * WINDOW_S, nonce))
        return None


class _Method:
    def __init__(self, method: Any, name: str, key: str) -> None:
        self._method, self._name, self._key = method, name, key

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if "token" in kwargs:
            raise TypeError(f"{self._name}: a signed handle adds token= itself")
        return self._method.remote(*args, token=sign(self._key, self._name), **kwargs)

    def options(self, **options: Any) -> _Method:
        return _Method(self._method.options(**options), self._name, self._key)


class Signed:
    """An actor handle whose every call carries a fresh token signed with ``credential``'s call key; ``handle``
    is the plain one (for ``ray.kill``). Pickles with the handle and the call key, never the credential."""

    def __init__(self, handle: Any, credential: str | None = None, *, key: str | None = None) -> None:
        if (credential is None) == (key is None):
            raise TypeError("Signed takes a credential or a call key, one of them")
        self.handle = handle
        self._key = key if key is not None else call_key(cast(str, credential))

    @classmethod
    def under(cls, handle: Any, key: str) -> Signed:
        """``handle`` with its calls signed under the call key ``key`` (what a holder of the key alone can do)."""
        return cls(handle, key=key)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(getattr(self.handle, name), name, self._key)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Signed.under, (self.handle, self._key))

    def __repr__(self) -> str:
        return f"Signed({self.handle!r})"
