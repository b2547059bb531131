"""A signal as a notice (elastic.placements.signal_notice), with real signals to this process; and its settings."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from elastic.config import NoticeSources
from elastic.errors import ConfigError
from elastic.log import get_logger
from elastic.placements.signal_notice import EXIT_ON_SECOND, SignalNotice


@pytest.fixture
def restore_usr1():
    previous = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, previous)


def test_the_first_signal_gives_one_notice_the_second_ends_the_process_and_the_grace_end_too(restore_usr1) -> None:
    given: list[tuple[float, str]] = []
    exits: list[int] = []
    noticed, ended = threading.Event(), threading.Event()

    def give(deadline: float, reason: str) -> None:
        given.append((deadline, reason))
        noticed.set()

    def exit_(code: int) -> None:
        exits.append(code)
        ended.set()

    notice = SignalNotice("SIGUSR1", 0.3, give, get_logger("test"), exit=exit_)
    assert notice.install()
    before = time.time()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert noticed.wait(5), "no notice given"
    ((deadline, reason),) = given
    assert before + 0.3 <= deadline <= time.time() + 0.3 and "SIGUSR1" in reason
    assert ended.wait(5) and exits == [EXIT_ON_SECOND + signal.SIGUSR1]  # the grace period's end
    os.kill(os.getpid(), signal.SIGUSR1)  # a second signal: at once, and no second notice
    assert exits == [EXIT_ON_SECOND + signal.SIGUSR1] * 2 and len(given) == 1


def test_off_the_main_thread_nothing_is_installed(restore_usr1) -> None:
    notice = SignalNotice("SIGUSR1", 1.0, lambda d, r: None, get_logger("test"), exit=lambda c: None)
    box: list[bool] = []
    thread = threading.Thread(target=lambda: box.append(notice.install()))
    thread.start()
    thread.join()
    assert box == [False] and signal.getsignal(signal.SIGUSR1) is not notice._handle


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"signal": "SIGNOPE"}, "signal's name"),
        ({"signal": "TERM"}, "signal's name"),
        ({"signal": "SIGKILL"}, "cannot catch"),
        ({"signal_grace_s": 0}, "signal_grace_s"),
    ],
)
def test_bad_signal_settings_are_one_clear_error(kwargs, words) -> None:
    with pytest.raises(ConfigError, match=words):
        NoticeSources(**kwargs)


def test_no_signal_is_a_setting() -> None:
    assert NoticeSources(signal=None).signal is None and NoticeSources().signal == "SIGTERM"
