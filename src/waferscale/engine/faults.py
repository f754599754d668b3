"""Test hooks that make parts of the engine fail on purpose. Empty (and free) unless a test or
--enable-fault-injection sets them; never part of a request's parameters."""

from __future__ import annotations

from collections.abc import Callable


class KillEngineThread(BaseException):
    """Raised by a hook to end the engine thread itself (what no ordinary exception may do): supervision tests."""


class FaultHooks:
    def __init__(self) -> None:
        self.fail_after: dict[str, int] = {}  # request id -> fail its sampling once it has this many tokens
        self.on_add: Callable[[str], None] | None = None  # called with each request id as it is added
        self.on_step: Callable[[], None] | None = None  # called at the start of every step, inside its guard

    def check_sample(self, request_id: str, num_generated: int) -> None:
        after = self.fail_after.get(request_id)
        if after is not None and num_generated >= after:
            raise RuntimeError("injected fault")
