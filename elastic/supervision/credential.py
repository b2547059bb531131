"""A job's credential: what every operation on its supervisor, keepers and event stream must carry.

The client makes one random token per job (:func:`new_token`) and hands out only what each side needs, derived
from it with HMAC-SHA256 under a label (:func:`derive`):

- the supervisor keeps the call keys (:func:`~elastic.snapshot.calls.call_key`) of the token and of the *agent*
  credential, not the token: a command needs the token, a registration or heartbeat the agent credential;
- agents (and multi-process workers) hold the agent credential only: it registers and beats, nothing else;
- keepers check the *keeper* credential's call key; the images they hold carry a MAC under the *image* key, which
  only the client holds (:mod:`snapshot.keeper`);
- the event stream's records carry a MAC under the *stream* key (:mod:`elastic.supervision.events`), held by the
  client and the supervisor (which writes records too).

No call carries a credential itself: :class:`Credentialed` (:class:`~elastic.snapshot.calls.Signed`) wraps an actor
handle so that every ``handle.method.remote(...)`` carries a token signed for that one call, which the actor
accepts once (:mod:`elastic.snapshot.calls`).
"""

from __future__ import annotations

import secrets

from elastic.snapshot.calls import Signed, derive

__all__ = ["Credentialed", "derive", "new_token"]

Credentialed = Signed


def new_token() -> str:
    """A fresh job token: 32 random bytes, hex."""
    return secrets.token_hex(32)
