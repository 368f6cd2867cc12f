"""Exceptions every layer raises and the client re-raises.

Each error has a stable ``code`` so it can cross the wire as an ``Error`` message
and be rebuilt as the same class on the other side (see ``wire.messages.Error``).
"""

from __future__ import annotations


class PwmeshError(Exception):
    """Base class of every pwmesh error."""

    code = "internal"

    def __init__(self, message: str, *, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        if self.remote_traceback:
            return f"{self.message}\n\nRemote traceback:\n{self.remote_traceback}"
        return self.message


class RemoteError(PwmeshError):
    """A user function (or a daemon) raised on a remote host; carries its traceback."""

    code = "remote"


class DeviceLost(PwmeshError):
    """A host or device that held or was computing the value is gone."""

    code = "device_lost"


class ResourceExhausted(PwmeshError):
    """The request can never be satisfied by the cluster as it is (devices, memory)."""

    code = "resource_exhausted"


class ProtocolError(PwmeshError):
    """A peer sent a frame that is malformed, oversized, of another version or unknown."""

    code = "protocol"


class PwTimeoutError(PwmeshError, TimeoutError):
    """A peer did not answer within the stated number of seconds."""

    code = "timeout"


class ConnectionFailed(PwmeshError, ConnectionError):
    """No daemon answered at the given address."""

    code = "connection_failed"


class InvalidArgument(PwmeshError, ValueError):
    """The request is well-formed but makes no sense (bad shapes, unknown ids...)."""

    code = "invalid_argument"


class NotFound(PwmeshError, KeyError):
    """An id (buffer, slice, function, session) that the daemon does not know."""

    code = "not_found"

    def __str__(self) -> str:  # KeyError would repr() the message
        return PwmeshError.__str__(self)


class NoSession(NotFound):
    """The proxy has no session for this connection: it restarted (a client with a resume token takes its
    session back, ``pwmesh.proxy.resume``), or the session ended or expired."""

    code = "no_session"


STANDBY = "this proxy is a standby"  # how a standby proxy's ``Unavailable`` begins (its clients move on)


class Unavailable(PwmeshError):
    """The daemon stopped (or restarted, e.g. into its island's next JAX group) before it answered: the
    request was not carried out, and may be sent again."""

    code = "unavailable"


class SliceSuspended(Unavailable):
    """A run or put on a suspended slice (``Slice.suspend``, ``pwmesh suspend``): nothing was run; resume the
    slice (``Slice.resume``) and call again."""

    code = "slice_suspended"


class DeadlineExceeded(PwmeshError):
    """A run went on past its tenant's ``max_run_seconds``: what it had not produced fails with this."""

    code = "deadline_exceeded"


class PermissionDenied(PwmeshError):
    """The sender's key may not do this: an operation of another role (a daemon's, an admin's), or on
    something another tenant owns. Nothing was changed."""

    code = "permission_denied"


_BY_CODE: dict[str, type[PwmeshError]] = {
    cls.code: cls
    for cls in (
        PwmeshError,
        RemoteError,
        DeviceLost,
        ResourceExhausted,
        ProtocolError,
        PwTimeoutError,
        ConnectionFailed,
        InvalidArgument,
        NotFound,
        NoSession,
        Unavailable,
        SliceSuspended,
        PermissionDenied,
        DeadlineExceeded,
    )
}


def error_class(code: str) -> type[PwmeshError]:
    """The exception class for a wire error code (unknown codes map to the base)."""
    return _BY_CODE.get(code, PwmeshError)
