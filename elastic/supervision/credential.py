"""A job's credential: what every operation on its supervisor, keepers and event stream must carry.

The client makes one random token per job (:func:`new_token`) and hands out only what each side needs, derived
from it with HMAC-SHA256 under a label:

- the supervisor keeps the SHA-256 digests of the token and of the *agent* credential (:func:`derive` ``"agent"``),
  never the token itself: a command needs the token, a registration or heartbeat the agent credential;
- agents (and multi-process workers) hold the agent credential only: it registers and beats, nothing else;
- keepers keep the digest of the *keeper* credential; the images they hold carry a MAC under the *image* key,
  which only the client holds (:mod:`snapshot.keeper`);
- the event stream's records carry a MAC under the *stream* key (:mod:`elastic.supervision.events`), held by the
  client and the supervisor (which writes records too).

:class:`Credentialed` wraps an actor handle so that every ``handle.method.remote(...)`` carries ``token=``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

__all__ = ["Credentialed", "check", "derive", "digest", "new_token"]


def new_token() -> str:
    """A fresh job token: 32 random bytes, hex."""
    return secrets.token_hex(32)


def derive(token: str, label: str) -> str:
    """The credential for one use (``agent``, ``keeper``, ``stream``, ``image``) of the job token ``token``."""
    return hmac.new(token.encode(), label.encode(), hashlib.sha256).hexdigest()


def digest(token: str) -> str:
    """What a checker stores instead of the credential."""
    return hashlib.sha256(token.encode()).hexdigest()


def check(token: object, *digests: str | None) -> bool:
    """True if ``token`` is a string whose digest is one of ``digests`` (compared in constant time)."""
    if not isinstance(token, str):
        return False
    mine = digest(token)
    return any(d is not None and hmac.compare_digest(mine, d) for d in digests)


class _Method:
    def __init__(self, method: Any, token: str) -> None:
        self._method, self._token = method, token

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("token", self._token)
        return self._method.remote(*args, **kwargs)

    def options(self, **options: Any) -> _Method:
        return _Method(self._method.options(**options), self._token)


class Credentialed:
    """An actor handle whose calls carry ``token``; ``handle`` is the plain one (for ``ray.kill``). Pickles with
    both, so an agent given it calls the supervisor with the credential it was given."""

    def __init__(self, handle: Any, token: str) -> None:
        self.handle = handle
        self._token = token

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(getattr(self.handle, name), self._token)

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return (Credentialed, (self.handle, self._token))

    def __repr__(self) -> str:
        return f"Credentialed({self.handle!r})"
