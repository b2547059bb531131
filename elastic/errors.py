"""The one error root of the public API, and its subclasses.

Every error the public API raises on purpose is an :class:`ElasticError`; errors from the layers
below are re-raised as one ``from`` the original. Each pickles with its fields, so it survives
crossing a Ray actor boundary.
"""

from __future__ import annotations

__all__ = [
    "AccessError",
    "ClusterError",
    "ElasticError",
    "ConfigError",
    "GiveUpError",
    "NoticeError",
    "PoolError",
    "RecoveryTimeoutError",
    "SupervisorError",
    "SupervisorLostError",
]


class ElasticError(Exception):
    """Root of every error this project raises on purpose."""

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), self.args)


class ConfigError(ElasticError, ValueError):
    """Bad configuration or input; the message says what to fix. Nothing saved was touched."""


class GiveUpError(ElasticError):
    """The supervisor gave up on the job (too few slices for too long, or too many failures)."""

    def __init__(self, reason: str, *, epoch: int = -1) -> None:
        super().__init__(f"the job gave up at epoch {epoch}: {reason}")
        self.reason = reason
        self.epoch = epoch

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_give_up, (self.reason, self.epoch))


def _rebuild_give_up(reason: str, epoch: int) -> GiveUpError:
    return GiveUpError(reason, epoch=epoch)


class RecoveryTimeoutError(ElasticError, TimeoutError):
    """A wait during recovery (a new membership view, the supervisor) ran past its bound."""


class SupervisorError(ElasticError):
    """The supervisor could not be started or reached."""


class SupervisorLostError(SupervisorError):
    """The supervisor is gone for good (killed, or unreachable past a bound): the job cannot be supervised
    any more and ends."""


class AccessError(SupervisorError, PermissionError):
    """An operation on a job's supervisor, keepers or stream without that job's credential (or with another's)."""


class ClusterError(ElasticError, ConnectionError):
    """The Ray cluster could not be joined (unreachable, or it asks for a token this process lacks); the message
    says what to set."""


class NoticeError(ElasticError, ValueError):
    """A notice that a slice is leaving was refused (a slice the job does not hold, a deadline already past, or a
    notice that is not well formed); the job is unharmed."""


class PoolError(ElasticError):
    """A job's lease from a pool of slices could not be had (the pool is not there, or the job waited past its
    bound for its minimum; the message says why it waits)."""
