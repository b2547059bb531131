"""Which errors mean a lost slice: ``runtime.classify``."""

from __future__ import annotations

import jax
import pytest

from elastic.runtime.classify import FailureKind, classify_failure, is_recoverable, is_slice_loss
from elastic.runtime.faults import DeviceUnavailableError, TransientUnavailableError
from elastic.runtime.guard import StepHungError

Jre = jax.errors.JaxRuntimeError
LOSS, HUNG, OTHER = FailureKind.SLICE_LOSS, FailureKind.HUNG, FailureKind.OTHER

CASES = [
    # Slice loss: status codes XLA runtimes use for lost devices, hosts or collectives.
    ("data-loss", Jre("DATA_LOSS: Slice 1 health check failed; all-reduce result is incomplete"), LOSS),
    ("unavailable", Jre("UNAVAILABLE: Connection to TPU worker 3 (10.0.0.12:8471) was lost"), LOSS),
    ("unavailable-socket", Jre("UNAVAILABLE: failed to send RPC: Socket closed"), LOSS),
    ("aborted", Jre("ABORTED: Collective operation all-reduce.3 aborted because a peer task died"), LOSS),
    ("internal-tpu-halted", Jre("INTERNAL: TPU halted unexpectedly: chip 2 core 0 reported a fatal error"), LOSS),
    (
        "internal-failed-to-connect",
        Jre("INTERNAL: failed to connect to all addresses; last error: 10.0.0.7:8476"),
        LOSS,
    ),
    ("internal-heartbeat", Jre("INTERNAL: Missed heartbeat from task /job:worker/task:2"), LOSS),
    ("internal-connection-reset", Jre("INTERNAL: Connection reset by peer while streaming buffers"), LOSS),
    ("internal-barrier", Jre("INTERNAL: Barrier timed out. Id: sync_devices; 1 of 4 tasks did not arrive"), LOSS),
    ("internal-slice-down", Jre("INTERNAL: slice 3 is down"), LOSS),
    ("prefixed-type-name", Jre("jaxlib.xla_extension.XlaRuntimeError: UNAVAILABLE: devices unreachable"), LOSS),
    ("leading-whitespace", Jre("  DATA_LOSS: lost shard"), LOSS),
    # The runtime's own: a simulated slice's device failure and an injected transient, read as a real UNAVAILABLE.
    ("simulated-device", DeviceUnavailableError("UNAVAILABLE: simulated slice 2 failed"), LOSS),
    ("injected-transient", TransientUnavailableError("UNAVAILABLE: injected transient failure at step 3"), LOSS),
    # A step that made no progress within step_timeout_s (the step watchdog): recovered, but not a slice loss.
    ("step-hung", StepHungError("step 12", 30.0, pending=3, total=3), HUNG),
    # Not a slice loss: bugs, bad input, memory.
    (
        "invalid-argument",
        Jre(
            "INVALID_ARGUMENT: Argument does not match host shape or layout of computation "
            "parameter 0: want f32[8,4], got f32[8,3]"
        ),
        OTHER,
    ),
    ("resource-exhausted", Jre("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes."), OTHER),
    ("internal-compiler-bug", Jre("INTERNAL: some compiler bug: RET_CHECK failure hlo_instruction.cc:1234"), OTHER),
    ("internal-halting-is-not-halted", Jre("INTERNAL: while loop halting condition has wrong shape"), OTHER),
    ("failed-precondition", Jre("FAILED_PRECONDITION: Buffer has been deleted or donated."), OTHER),
    ("code-word-later-in-message", Jre("INVALID_ARGUMENT: expected UNAVAILABLE: got something else"), OTHER),
    ("no-status-code", Jre("something went wrong: UNAVAILABLE: x"), OTHER),
    ("plain-value-error", ValueError("UNAVAILABLE: shapes do not match"), OTHER),
    ("runtime-error-not-jax", RuntimeError("UNAVAILABLE: x"), OTHER),
    ("runtime-error-halted", RuntimeError("INTERNAL: TPU halted"), OTHER),
    ("keyboard-interrupt", KeyboardInterrupt(), OTHER),
    ("plain-timeout", TimeoutError("step 12 made no progress"), OTHER),
]


@pytest.mark.parametrize(("err", "kind"), [pytest.param(e, k, id=i) for i, e, k in CASES])
def test_classify(err, kind):
    assert classify_failure(err) is kind
    assert is_slice_loss(err) is (kind is LOSS)
    assert is_recoverable(err) is (kind is not OTHER)


def _raise_from(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise RuntimeError("step 12 failed") from e
    except RuntimeError as outer:
        return outer


def _raise_during(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:  # noqa: BLE001 - re-raised as the chained case
            raise KeyError("while handling the failure")  # noqa: B904 (the implicit __context__ is the case)
    except KeyError as outer:
        return outer


def _chain(inner: BaseException, depth: int) -> BaseException:
    err = inner
    for i in range(depth):
        err = _raise_from(err) if i % 2 else _raise_during(err)
    return err


@pytest.mark.parametrize(
    ("make", "inner", "kind"),
    [
        pytest.param(_raise_from, Jre("UNAVAILABLE: slice 2 unreachable"), LOSS, id="cause-loss"),
        pytest.param(_raise_from, Jre("INVALID_ARGUMENT: bad shape"), OTHER, id="cause-other"),
        pytest.param(_raise_during, Jre("DATA_LOSS: lost"), LOSS, id="context-loss"),
        pytest.param(_raise_during, Jre("INTERNAL: some compiler bug"), OTHER, id="context-other"),
        pytest.param(lambda e: _chain(e, 4), Jre("ABORTED: peer died"), LOSS, id="deep-chain-loss"),
        pytest.param(lambda e: _chain(e, 4), ValueError("ABORTED: x"), OTHER, id="deep-chain-not-jax"),
        pytest.param(_raise_from, StepHungError("step 3", 1.0), HUNG, id="cause-hung"),
    ],
)
def test_classify_through_chain(make, inner, kind):
    outer = make(inner)
    assert not isinstance(outer, jax.errors.JaxRuntimeError)
    assert outer.__cause__ is not None or outer.__context__ is not None
    assert classify_failure(outer) is kind


def test_classify_cycle_terminates():
    a = RuntimeError("a")
    b = Jre("INVALID_ARGUMENT: b")
    a.__context__ = b
    b.__context__ = a
    assert classify_failure(a) is OTHER


def test_classify_cycle_with_loss_found():
    a = RuntimeError("a")
    b = Jre("UNAVAILABLE: b")
    a.__cause__ = b
    b.__context__ = a
    assert classify_failure(a) is LOSS


def test_a_loss_the_runtime_saw_itself_is_a_slice_loss_by_type_not_by_text():
    from elastic.runtime import SliceLostError, classify_failure
    from elastic.runtime.classify import FailureKind

    lost = SliceLostError("group 3 broke (slice 1: worker process died)", slices=(1,))
    assert classify_failure(lost) is FailureKind.SLICE_LOSS and lost.slices == (1,)
    wrapped = RuntimeError("in the pass")
    wrapped.__cause__ = lost
    assert classify_failure(wrapped) is FailureKind.SLICE_LOSS
    assert classify_failure(RuntimeError("UNAVAILABLE: group 3 broke")) is FailureKind.OTHER  # text alone is not it
