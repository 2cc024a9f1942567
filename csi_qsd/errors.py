"""The driver's exception tree: each class carries the gRPC code the CSI spec names.

Domain code raises these; the gRPC layer maps them to a status in exactly one
place (`csi_qsd.csi.errors`). Subclasses keep their parent's code, so matching
is by `isinstance`, never by exact type. Every exception the driver defines
lives here, with the evidence some carry (a wedged QSD's report). This module
must not import grpc, nor anything of the driver.
"""

from __future__ import annotations

import dataclasses
import enum


class Code(enum.Enum):
    """The gRPC status codes the driver answers with (names match grpc.StatusCode)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    ABORTED = "ABORTED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class DriverError(Exception):
    """Base of every error the driver reports to a caller; message is for an operator."""

    code: Code = Code.INTERNAL


class InvalidArgument(DriverError):
    code = Code.INVALID_ARGUMENT


class NotFound(DriverError):
    code = Code.NOT_FOUND


class AlreadyExists(DriverError):
    code = Code.ALREADY_EXISTS


class FailedPrecondition(DriverError):
    code = Code.FAILED_PRECONDITION


class ResourceExhausted(DriverError):
    code = Code.RESOURCE_EXHAUSTED


class OutOfRange(DriverError):
    code = Code.OUT_OF_RANGE


class Aborted(DriverError):
    code = Code.ABORTED


class PermissionDenied(DriverError):
    """An authenticated caller asked for what its identity does not allow (another node's copy)."""

    code = Code.PERMISSION_DENIED


class Unimplemented(DriverError):
    code = Code.UNIMPLEMENTED


class Unavailable(DriverError):
    code = Code.UNAVAILABLE


class DriverUnhealthy(Unavailable):
    """A driver a helper watches (registrar, liveness probe) did not answer in time, failed, or is not ready."""


class StillInUse(Unavailable):
    """A volume's loop device is still held after its last unpublish and unstage: its filesystem lives on in
    another mount namespace, or a process still has the device open. The device and the export must stay until
    that ends and what it holds (dirty pages, a journal) is written."""


class Internal(DriverError):
    code = Code.INTERNAL


class SourceLost(FailedPrecondition):
    """A copy's source node no longer serves the snapshot the copy was reading (its lease expired or was dropped,
    or the snapshot is gone): what was not copied yet cannot be had any more."""


class SourceUnreachable(Unavailable):
    """A volume reads data not yet copied from another node whose copy server does not greet.

    QSD must not open the volume's chain until it does (the open would hold
    QSD's monitor). `node` names the source node ('' if no copy row names
    it), `address` the server's host:port.
    """

    def __init__(self, message: str, *, node: str, address: str) -> None:
        super().__init__(message)
        self.node = node
        self.address = address


class QSDError(Internal):
    """qemu-storage-daemon refused a command or could not be reached.

    `error_class` is QEMU's own class for a refused command (`GenericError`,
    `CommandNotFound`, `DeviceNotFound`, ...), None when QSD gave no answer.
    Callers decide by it, never by the English text of the message.
    """

    def __init__(self, message: str, *, error_class: str | None = None) -> None:
        super().__init__(message)
        self.error_class = error_class


class QSDUnavailable(QSDError, Unavailable):
    """qemu-storage-daemon went away or stopped answering: transient, the call may be retried."""

    code = Code.UNAVAILABLE


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A command sent to QSD and not yet answered: what, since when (event-loop time), on which session."""

    command: str
    started: float
    session: int


@dataclasses.dataclass(frozen=True)
class NoAnswer:
    """What a client saw when QSD left a command unanswered past the timeout: the evidence of a wedge."""

    command: str
    waited: float
    session: int
    in_flight: tuple[InFlight, ...]


class QSDNoAnswer(QSDUnavailable):
    """QSD did not answer a command (or the QMP greeting) within the timeout: its monitor is stuck.

    The call may be retried: the supervisor kills and replaces a QSD that
    stops answering. `report` is what the client saw.
    """

    def __init__(self, message: str, report: NoAnswer) -> None:
        super().__init__(message)
        self.report = report


class HostCommandError(Internal):
    """A host tool (losetup, mkfs, mount, qemu-img) failed."""


class NBDError(HostCommandError):
    """An NBD server (qemu-nbd) refused a request, broke the protocol, or would not go away."""


class Forwarded(DriverError):
    """Another driver's error (a node plugin answering the snapshot-metadata router), passed on with its code."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code


class StartupError(DriverError):
    """The driver cannot start as configured (a busy port, a bad endpoint); the message says which."""
