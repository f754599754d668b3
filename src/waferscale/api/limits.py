"""Per-key rate limits as the hosted service applies them: token buckets that refill continuously, a reservation
taken up front and settled when the request ends. Pure: no HTTP, no model; the clock is injectable for tests."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

Clock = Callable[[], float]
MINUTE, DAY = 60.0, 86_400.0


@dataclass(frozen=True)
class Limits:
    """A key's limits; None means no limit for that window. Token limits count prompt plus completion tokens;
    the uncached ones leave out prompt tokens served from the prefix cache."""

    requests_per_minute: int | None = None
    requests_per_day: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    uncached_tokens_per_minute: int | None = None
    uncached_tokens_per_day: int | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


# field -> (what it counts, the window's header suffix, its period in seconds)
WINDOWS = {
    "requests_per_minute": ("requests", "requests-minute", MINUTE),
    "requests_per_day": ("requests", "requests-day", DAY),
    "tokens_per_minute": ("tokens", "tokens-minute", MINUTE),
    "tokens_per_day": ("tokens", "tokens-day", DAY),
    "uncached_tokens_per_minute": ("uncached", "uncached-tokens-minute", MINUTE),
    "uncached_tokens_per_day": ("uncached", "uncached-tokens-day", DAY),
}


class TokenBucket:
    """`capacity` units that refill continuously at capacity/period per second, up to capacity."""

    def __init__(self, capacity: int, period: float, now: float):
        self.capacity, self.period = capacity, period
        self.level, self._stamp = float(capacity), now

    @property
    def rate(self) -> float:
        return self.capacity / self.period

    def available(self, now: float) -> float:
        """Units in the bucket at `now` (negative while a charge above a reservation is being paid back)."""
        if now > self._stamp:
            self.level = min(self.capacity, self.level + (now - self._stamp) * self.rate)
            self._stamp = now
        return self.level

    def take(self, amount: float, now: float) -> None:
        self.available(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        self.available(now)
        self.level = min(self.capacity, self.level + amount)

    def wait(self, amount: float, now: float) -> float:
        """Seconds until `amount` units are available (infinite when it exceeds the capacity)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.available(now)) / self.rate)

    def until_full(self, now: float) -> float:
        """Seconds until the bucket is full again: the hosted service's `x-ratelimit-reset-*`."""
        return max(0.0, (self.capacity - self.available(now)) / self.rate)

    def resize(self, capacity: int, now: float) -> None:
        """A new limit: what was used stays used (the level moves by the change, never above the new capacity)."""
        self.available(now)
        self.level = min(capacity, self.level + capacity - self.capacity)
        self.capacity = capacity


class QuotaExceeded(Exception):
    """A reservation refused: which window, what the client should do, and when a retry can succeed."""

    def __init__(self, window: str, message: str, code: str, retry_after: float):
        super().__init__(message)
        self.window, self.message, self.code, self.retry_after = window, message, code, retry_after


@dataclass
class Reservation:
    """What one request took from its key's buckets: 1 request, `tokens` from every token window."""

    quota: KeyQuota
    tokens: int
    settled: bool = False

    def settle(self, used_tokens: int, used_uncached: int) -> None:
        """Give back what the request did not use (once; later calls do nothing)."""
        if not self.settled:
            self.settled = True
            self.quota._settle(self, used_tokens, used_uncached)

    def cancel(self) -> None:
        """The request never ran: give everything back, the request itself included."""
        if not self.settled:
            self.settled = True
            self.quota._settle(self, 0, 0, request=True)


_MESSAGES = {
    "requests-minute": "Requests per minute limit exceeded - too many requests sent.",
    "requests-day": "Requests per day limit exceeded - too many requests sent.",
    "tokens-minute": "Tokens per minute limit exceeded - too many tokens processed.",
    "tokens-day": "Tokens per day limit exceeded - too many tokens processed.",
    "uncached-tokens-minute": "Uncached tokens per minute limit exceeded - too many tokens processed.",
    "uncached-tokens-day": "Uncached tokens per day limit exceeded - too many tokens processed.",
}


class KeyQuota:
    """One key's buckets. `reserve` takes a request and its estimated tokens from every window or from none."""

    def __init__(self, limits: Limits, clock: Clock = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[str, TokenBucket]] = {}  # header suffix -> (what it counts, bucket)
        self.limits = Limits()
        self.update(limits)

    @property
    def unlimited(self) -> bool:
        return not self._buckets

    def update(self, limits: Limits) -> None:
        """New limits (a reloaded key file): kept windows keep what was used, new ones start full."""
        now = self.clock()
        with self._lock:
            buckets = {}
            for name, (counts, suffix, period) in WINDOWS.items():
                limit = getattr(limits, name)
                if limit is None:
                    continue
                old = self._buckets.get(suffix)
                if old is not None:
                    old[1].resize(limit, now)
                    buckets[suffix] = old
                else:
                    buckets[suffix] = (counts, TokenBucket(limit, period, now))
            self._buckets, self.limits = buckets, limits

    def reserve(self, tokens: int) -> Reservation:
        """Take one request and `tokens` from every window, or raise QuotaExceeded and take nothing. Nothing is
        known cached before the request runs, so uncached windows reserve the whole estimate too."""
        now = self.clock()
        with self._lock:
            for suffix, (counts, bucket) in self._buckets.items():
                amount = 1 if counts == "requests" else tokens
                if bucket.available(now) >= amount:
                    continue
                wait = bucket.wait(amount, now)
                raise QuotaExceeded(suffix, _refusal(suffix, counts, amount, bucket, wait), _code(counts), wait)
            for counts, bucket in self._buckets.values():
                bucket.take(1 if counts == "requests" else tokens, now)
        return Reservation(self, tokens)

    def charge(self, tokens: int, uncached: int) -> None:
        """A finished batch request's usage, taken from the day windows only (batch work never counts against the
        per-minute ones) and refused nowhere: the runner waits with `day_wait` before it sends more."""
        now = self.clock()
        with self._lock:
            for suffix, (counts, bucket) in self._buckets.items():
                if suffix.endswith("-day"):
                    bucket.take({"requests": 1, "tokens": tokens}.get(counts, uncached), now)

    def day_wait(self) -> float:
        """Seconds until every day window has room again (0 when they all have some now)."""
        now = self.clock()
        with self._lock:
            waits = [
                bucket.wait(1, now) for suffix, (_, bucket) in self._buckets.items() if suffix.endswith("-day")
            ]
        return max(waits, default=0.0)

    def _settle(self, r: Reservation, used: int, uncached: int, *, request: bool = False) -> None:
        now = self.clock()
        with self._lock:
            for counts, bucket in self._buckets.values():
                if counts == "requests":
                    if request:
                        bucket.give(1, now)
                    continue
                spent = used if counts == "tokens" else uncached
                if spent <= r.tokens:
                    bucket.give(r.tokens - spent, now)
                else:  # more than reserved (not expected): charged all the same
                    bucket.take(spent - r.tokens, now)

    def headers(self) -> dict[str, str]:
        """`x-ratelimit-{limit,remaining,reset}-<window>` for every window this key has (none: no headers)."""
        now = self.clock()
        out: dict[str, str] = {}
        with self._lock:
            for suffix, (_, bucket) in self._buckets.items():
                out[f"x-ratelimit-limit-{suffix}"] = str(bucket.capacity)
                out[f"x-ratelimit-remaining-{suffix}"] = str(max(0, math.floor(bucket.available(now))))
                out[f"x-ratelimit-reset-{suffix}"] = f"{bucket.until_full(now):.3f}"
        return out


def _code(counts: str) -> str:
    return "request_quota_exceeded" if counts == "requests" else "token_quota_exceeded"


def _refusal(suffix: str, counts: str, amount: int, bucket: TokenBucket, wait: float) -> str:
    """The hosted service's sentence, then what this request needed and what the client can change."""
    per = "a minute" if bucket.period == MINUTE else "a day"
    head = _MESSAGES[suffix]
    if counts == "requests":
        return f"{head} The limit is {bucket.capacity} {per}; retry in {math.ceil(wait)} s."
    what = "tokens" if counts == "tokens" else "uncached tokens"
    need = (
        f"This request reserves {amount} tokens (its prompt plus max_tokens for each choice, the context left where "
        "max_tokens is unset)"
    )
    if math.isinf(wait):
        return (
            f"{head} {need}, more than the key's limit of {bucket.capacity} {what} {per}: set max_tokens "
            "(max_completion_tokens for chat) so that it fits."
        )
    left = max(0, math.floor(bucket.level))  # as of the check that refused the request
    return (
        f"{head} {need}; {left} of {bucket.capacity} {what} {per} are left: retry in {math.ceil(wait)} s or ask "
        "for fewer tokens."
    )
