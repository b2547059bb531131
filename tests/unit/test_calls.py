"""Signed calls: each token opens one method, once, near its time, under one key; the credential never travels."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import pytest

from elastic.snapshot import calls
from elastic.snapshot.calls import CallCheck, Signed, call_key, sign

KEY, OTHER = call_key("job-token"), call_key("another-token")


def test_a_signed_call_passes_once_and_its_replay_is_refused() -> None:
    check = CallCheck(KEY)
    token = sign(KEY, "view")
    assert check.refusal(token, "view") is None
    assert "replayed" in (check.refusal(token, "view") or "")
    assert check.refusal(sign(KEY, "view"), "view") is None  # a fresh token for the same method passes


@pytest.mark.parametrize(
    ("token", "method", "why"),
    [
        (None, "view", "no signed credential"),
        ("job-token", "view", "no signed credential"),  # the credential itself is not a call's token
        (b"c1.1.2.3", "view", "no signed credential"),
        ("c1." + "9" * 17 + "." + "a" * 32 + "." + "b" * 64, "view", "no signed credential"),
        (sign(KEY, "view"), "close", "not signed"),  # a token opens the method it was signed for only
        (sign(OTHER, "view"), "view", "not signed"),  # another job's key
    ],
)
def test_what_is_refused_and_why(token: Any, method: str, why: str) -> None:
    assert why in (CallCheck(KEY).refusal(token, method) or "")


def test_a_token_far_from_now_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    old = sign(KEY, "view")
    now = calls.time.time()
    monkeypatch.setattr(calls.time, "time", lambda: now + calls.WINDOW_S + 1)
    assert "away from now" in (CallCheck(KEY).refusal(old, "view") or "")


def test_nonces_are_forgotten_after_the_window_so_memory_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    check, now = CallCheck(KEY), calls.time.time()
    for _ in range(100):
        assert check.refusal(sign(KEY, "beat"), "beat") is None
    monkeypatch.setattr(calls.time, "time", lambda: now + 3 * calls.WINDOW_S)
    assert check.refusal(sign(KEY, "beat"), "beat") is None
    assert len(check._seen) == 1  # noqa: SLF001 - the bound is the point of the test


def test_keys_pick_which_credentials_a_method_accepts() -> None:
    check = CallCheck(KEY, OTHER)  # e.g. the job's token and its agents' credential
    assert check.refusal(sign(OTHER, "beat"), "beat", keys=(0, 1)) is None
    assert "not signed" in (check.refusal(sign(OTHER, "close"), "close", keys=(0,)) or "")
    assert CallCheck(None).open and CallCheck(None).refusal(None, "anything") is None


def test_concurrent_uses_of_one_token_pass_exactly_once() -> None:
    check, token, passed = CallCheck(KEY), sign(KEY, "put"), []
    threads = [threading.Thread(target=lambda: passed.append(check.refusal(token, "put") is None)) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert passed.count(True) == 1


class Method:
    def __init__(self, name: str, seen: list[tuple[str, dict[str, Any]]]) -> None:
        self.name, self.seen = name, seen

    def remote(self, *args: Any, **kwargs: Any) -> str:
        self.seen.append((self.name, kwargs))
        return self.name


class Handle:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Method:
        return Method(name, self.__dict__["seen"])


def test_a_signed_handle_signs_each_call_for_its_method_and_pickles_without_the_credential() -> None:
    handle = Handle()
    signed = Signed(handle, "job-token")
    signed.view.remote()
    signed.view.remote()
    (_, first), (_, second) = handle.seen
    check = CallCheck(KEY)
    assert check.refusal(first["token"], "view") is None and check.refusal(second["token"], "view") is None
    assert first["token"] != second["token"]
    with pytest.raises(TypeError, match="adds token= itself"):
        signed.view.remote(token="job-token")
    assert b"job-token" not in pickle.dumps(Signed(None, "job-token"))
    again = pickle.loads(pickle.dumps(Signed(None, "job-token")))
    assert check.refusal(sign(again._key, "view"), "view") is None  # noqa: SLF001 - the same key, pickled
