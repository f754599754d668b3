"""Per-key limits without the model or a server: token buckets on a fake clock (nothing sleeps)."""

from __future__ import annotations

import pytest

from waferscale.api.auth import Keyring
from waferscale.api.limits import KeyQuota, Limits, QuotaExceeded, TokenBucket


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_bucket_starts_full():
    assert TokenBucket(600, 60, now=0).available(0) == 600


def test_bucket_refills_continuously_not_at_the_end_of_the_window():
    bucket = TokenBucket(600, 60, now=0)  # 10 a second
    bucket.take(600, 0)
    assert bucket.available(1.5) == pytest.approx(15)
    assert bucket.available(30) == pytest.approx(300)


def test_bucket_never_refills_past_its_capacity():
    bucket = TokenBucket(600, 60, now=0)
    bucket.take(100, 0)
    assert bucket.available(3600) == 600


def test_bucket_says_how_long_until_an_amount_is_there():
    bucket = TokenBucket(600, 60, now=0)
    bucket.take(600, 0)
    assert bucket.wait(50, 0) == pytest.approx(5)
    assert bucket.wait(601, 0) == float("inf")  # more than it can ever hold


def test_bucket_reset_is_the_time_until_full():
    bucket = TokenBucket(600, 60, now=0)
    bucket.take(120, 0)
    assert bucket.until_full(0) == pytest.approx(12)


def test_reservation_takes_the_estimate_from_every_token_window(clock):
    quota = KeyQuota(Limits(tokens_per_minute=1000, tokens_per_day=50_000), clock)
    quota.reserve(300)
    h = quota.headers()
    assert h["x-ratelimit-remaining-tokens-minute"] == "700"
    assert h["x-ratelimit-remaining-tokens-day"] == "49700"


def test_settling_gives_back_what_the_request_did_not_use(clock):
    quota = KeyQuota(Limits(tokens_per_minute=1000), clock)
    r = quota.reserve(300)
    r.settle(used_tokens=40, used_uncached=40)
    assert quota.headers()["x-ratelimit-remaining-tokens-minute"] == "960"


def test_settling_twice_gives_back_once(clock):
    quota = KeyQuota(Limits(tokens_per_minute=1000), clock)
    r = quota.reserve(300)
    r.settle(40, 40)
    quota.reserve(500)
    r.settle(0, 0)
    assert quota.headers()["x-ratelimit-remaining-tokens-minute"] == "460"


def test_a_cancelled_reservation_gives_back_the_request_too(clock):
    quota = KeyQuota(Limits(requests_per_day=10, tokens_per_minute=1000), clock)
    quota.reserve(300).cancel()
    h = quota.headers()
    assert (h["x-ratelimit-remaining-requests-day"], h["x-ratelimit-remaining-tokens-minute"]) == ("10", "1000")


def test_over_the_token_limit_is_refused_and_takes_nothing(clock):
    quota = KeyQuota(Limits(requests_per_day=10, tokens_per_minute=1000), clock)
    quota.reserve(800)
    with pytest.raises(QuotaExceeded) as exc:
        quota.reserve(300)
    assert exc.value.code == "token_quota_exceeded"
    assert exc.value.window == "tokens-minute"
    assert exc.value.retry_after == pytest.approx(6)  # 100 missing at 1000/60 a second
    h = quota.headers()
    assert (h["x-ratelimit-remaining-requests-day"], h["x-ratelimit-remaining-tokens-minute"]) == ("9", "200")


def test_over_the_request_limit_has_the_hosted_code_and_message(clock):
    quota = KeyQuota(Limits(requests_per_minute=2), clock)
    quota.reserve(1)
    quota.reserve(1)
    with pytest.raises(QuotaExceeded) as exc:
        quota.reserve(1)
    assert exc.value.code == "request_quota_exceeded"
    assert exc.value.message.startswith("Requests per minute limit exceeded - too many requests sent.")
    assert exc.value.retry_after == pytest.approx(30)


def test_a_request_larger_than_the_limit_is_told_to_ask_for_fewer_tokens(clock):
    quota = KeyQuota(Limits(tokens_per_minute=1000), clock)
    with pytest.raises(QuotaExceeded) as exc:
        quota.reserve(1001)
    assert exc.value.retry_after == float("inf")
    assert "max_tokens" in exc.value.message


def test_a_refused_request_succeeds_once_the_bucket_has_refilled(clock):
    quota = KeyQuota(Limits(tokens_per_minute=600), clock)
    quota.reserve(600)
    with pytest.raises(QuotaExceeded):
        quota.reserve(100)
    clock.advance(10)
    quota.reserve(100)


def test_minute_window_recovers_while_the_day_window_stays_spent(clock):
    quota = KeyQuota(Limits(requests_per_minute=1, requests_per_day=2), clock)
    quota.reserve(1)
    clock.advance(60)
    quota.reserve(1)
    clock.advance(60)
    with pytest.raises(QuotaExceeded) as exc:
        quota.reserve(1)
    assert exc.value.window == "requests-day"
    assert exc.value.message.startswith("Requests per day limit exceeded")


def test_day_window_refills_over_the_day(clock):
    quota = KeyQuota(Limits(requests_per_day=24), clock)  # one an hour
    for _ in range(24):
        quota.reserve(0)
    clock.advance(3600)
    quota.reserve(0)
    with pytest.raises(QuotaExceeded) as exc:
        quota.reserve(0)
    assert exc.value.retry_after == pytest.approx(3600)


def test_cached_prompt_tokens_are_given_back_to_uncached_windows_only(clock):
    quota = KeyQuota(Limits(tokens_per_minute=10_000, uncached_tokens_per_minute=10_000), clock)
    r = quota.reserve(1100)  # nothing is known cached before it runs: both take the whole estimate
    assert quota.headers()["x-ratelimit-remaining-uncached-tokens-minute"] == "8900"
    r.settle(used_tokens=1000, used_uncached=200)  # 800 of its 900 prompt tokens came from the prefix cache
    h = quota.headers()
    assert h["x-ratelimit-remaining-tokens-minute"] == "9000"
    assert h["x-ratelimit-remaining-uncached-tokens-minute"] == "9800"


def test_uncached_limit_refuses_on_its_own(clock):
    quota = KeyQuota(Limits(tokens_per_minute=10_000, uncached_tokens_per_minute=1000), clock)
    with pytest.raises(QuotaExceeded) as exc:
        quota.reserve(1500)
    assert exc.value.window == "uncached-tokens-minute"
    assert exc.value.message.startswith("Uncached tokens per minute limit exceeded")


def test_headers_name_only_the_windows_a_key_has(clock):
    quota = KeyQuota(Limits(requests_per_day=100, tokens_per_minute=1000), clock)
    assert set(quota.headers()) == {
        "x-ratelimit-limit-requests-day",
        "x-ratelimit-remaining-requests-day",
        "x-ratelimit-reset-requests-day",
        "x-ratelimit-limit-tokens-minute",
        "x-ratelimit-remaining-tokens-minute",
        "x-ratelimit-reset-tokens-minute",
    }


def test_an_unlimited_key_sends_no_headers(clock):
    quota = KeyQuota(Limits(), clock)
    assert quota.unlimited and quota.headers() == {}


def test_reset_headers_are_fractional_seconds_until_full(clock):
    quota = KeyQuota(Limits(requests_per_day=86_400 // 4, tokens_per_minute=1000), clock)
    quota.reserve(250)
    clock.advance(0.5)
    h = quota.headers()
    assert float(h["x-ratelimit-reset-requests-day"]) == pytest.approx(3.5)
    assert float(h["x-ratelimit-reset-tokens-minute"]) == pytest.approx(14.5)


def test_new_limits_keep_what_was_used(clock):
    quota = KeyQuota(Limits(tokens_per_minute=1000), clock)
    quota.reserve(400)
    quota.update(Limits(tokens_per_minute=2000, requests_per_day=5))
    h = quota.headers()
    assert h["x-ratelimit-remaining-tokens-minute"] == "1600"
    assert h["x-ratelimit-remaining-requests-day"] == "5"  # a new window starts full


def test_a_lower_limit_never_leaves_more_than_it_allows(clock):
    quota = KeyQuota(Limits(tokens_per_minute=1000), clock)
    quota.update(Limits(tokens_per_minute=100))
    assert quota.headers()["x-ratelimit-remaining-tokens-minute"] == "100"


def _keyfile(tmp_path, text: str):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return path


def test_two_keys_do_not_share_a_bucket(tmp_path, clock):
    path = _keyfile(
        tmp_path,
        '[keys.alice]\nkey = "sk-a"\ntokens_per_minute = 1000\n[keys.bob]\nkey = "sk-b"\ntokens_per_minute = 1000\n',
    )
    ring = Keyring(file=path, clock=clock)
    ring.identify("sk-a").quota.reserve(900)
    assert ring.identify("sk-b").quota.headers()["x-ratelimit-remaining-tokens-minute"] == "1000"
    assert ring.identify("sk-a").quota.headers()["x-ratelimit-remaining-tokens-minute"] == "100"


def test_reload_keeps_a_kept_keys_bucket_and_adds_new_keys(tmp_path, clock):
    path = _keyfile(tmp_path, '[keys.alice]\nkey = "sk-a"\ntokens_per_minute = 1000\n')
    ring = Keyring(file=path, clock=clock)
    alice = ring.identify("sk-a")
    alice.quota.reserve(600)
    path.write_text('[keys.alice]\nkey = "sk-a"\ntokens_per_minute = 1000\n[keys.carol]\nkey = "sk-c"\n')
    ring.reload()
    assert ring.identify("sk-a") is alice
    assert alice.quota.headers()["x-ratelimit-remaining-tokens-minute"] == "400"
    assert ring.identify("sk-c").name == "carol"


def test_a_removed_key_is_refused_but_its_usage_stays(tmp_path, clock):
    path = _keyfile(tmp_path, '[keys.alice]\nkey = "sk-a"\n[keys.bob]\nkey = "sk-b"\n')
    ring = Keyring(file=path, clock=clock)
    ring.identify("sk-b").usage.requests += 3
    path.write_text('[keys.alice]\nkey = "sk-a"\n')
    ring.reload()
    assert ring.identify("sk-b") is None
    assert ring.usage()["bob"].requests == 3  # counters never go back


def test_the_estimate_is_each_prompt_once_plus_each_sequences_max_tokens():
    from waferscale.api.pipeline import Run
    from waferscale.api.quota import estimate
    from waferscale.engine import SamplingParams

    # two prompts (3 and 5 tokens), each run twice (best_of 2), with max_tokens 10 and 20
    run = Run(None, "cmpl", [[1, 2, 3], [4, 5, 6, 7, 8]], [SamplingParams(max_tokens=10), SamplingParams(max_tokens=20)], 2)
    assert estimate(run) == 3 + 5 + 2 * 10 + 2 * 20
