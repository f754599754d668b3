"""The engine's error kinds. The engine says what went wrong; only the API decides which HTTP status that is."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorKind(str, enum.Enum):
    INVALID_REQUEST = (
        "invalid_request"  # the client's request cannot be served as asked (never retried as is)
    )
    OVERLOADED = "overloaded"  # not admitted in time: retry later or elsewhere
    SHUTTING_DOWN = "shutting_down"  # the server is draining
    UNAVAILABLE = "unavailable"  # the engine thread is not running: nothing will be served
    INTERNAL = "internal"  # a failure of the engine or the model while serving the request


@dataclass
class RequestError:
    """Why a request ended without an answer: a kind, a message meant for the client and the parameter at fault."""

    kind: ErrorKind
    message: str
    param: str | None = None


class EngineError(Exception):
    """Raised inside the engine for a failure that should reach the client with its kind (not as `internal`)."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None):
        super().__init__(message)
        self.error = RequestError(kind, message, param)


def internal_error(exc: BaseException) -> RequestError:
    """The client-facing error for an unexpected exception: its kind, never a traceback or a path."""
    if isinstance(exc, EngineError):
        return exc.error
    from waferscale.engine.grammar import GrammarError

    reason = f"grammar: {exc}" if isinstance(exc, GrammarError) else type(exc).__name__
    return RequestError(ErrorKind.INTERNAL, f"generation failed: {reason}")
