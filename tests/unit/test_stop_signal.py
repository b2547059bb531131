"""Save and stop, the pure parts: the transition a stop takes, and which signals may ask for it."""

from __future__ import annotations

import pytest

from elastic.control.stop_signal import SAME_SIGNAL_S, StopOnSignal, check_signal
from elastic.control.transitions import Finish, Machine, State, Stopped, transition
from elastic.errors import ConfigError
from elastic.supervision.membership import View


def test_a_stopped_pass_finishes_the_job_and_only_a_running_one_can_stop() -> None:
    view = View(epoch=1, active=frozenset({0, 1}))
    machine, action = transition(Machine(State.RUNNING, view), Stopped(7), 2)
    assert machine.state is State.FINISHED and isinstance(action, Finish)
    with pytest.raises(ValueError, match="no transition"):
        transition(Machine(State.RESTORING, view), Stopped(7), 2)


@pytest.mark.parametrize("name", ["SIGKILL", "SIGSTOP", "TERM", "SIGNOPE", 15])
def test_a_stop_signal_must_be_one_a_process_can_catch(name) -> None:
    with pytest.raises(ConfigError, match="stop_signal"):
        check_signal(name)


def test_the_first_signal_stops_and_a_later_one_ends_the_process() -> None:
    asked: list[str] = []

    class Log:
        def warning(self, *args, **kwargs) -> None:
            pass

    handler = StopOnSignal("SIGUSR1", asked.append, Log())
    handler._handle(10, None)
    assert asked and "SIGUSR1" in asked[0]
    handler._handle(10, None)  # the same request delivered twice (a process tree signalled, and forwarded)
    assert len(asked) == 1
    assert handler.first_at is not None
    handler.first_at -= SAME_SIGNAL_S
    with pytest.raises(SystemExit) as ended:
        handler._handle(10, None)
    assert ended.value.code == 138 and len(asked) == 1
