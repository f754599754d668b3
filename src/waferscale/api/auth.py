"""Bearer-key authentication: keys from --api-key / WAFERSCALE_API_KEY and --api-keys-file, each known by a name
with its own limits and usage; a sent key is hashed and compared with every key's digest in constant time."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from waferscale.api.errors import APIError
from waferscale.api.keys import KeyFileError, KeySpec, check_unique, flag_keys, load_key_file
from waferscale.api.limits import Clock, KeyQuota, Limits

log = logging.getLogger("waferscale.api")
SCOPE_KEY = "waferscale.key"  # the ASGI scope entry holding the request's Key once authenticated
ANONYMOUS = "anonymous"  # the name usage is counted under when the server has no keys


def parse_keys(*sources: str | None) -> list[str]:
    """Comma-separated keys from each source, blanks dropped."""
    keys: list[str] = []
    for source in sources:
        if source:
            keys.extend(k.strip() for k in source.split(",") if k.strip())
    return keys


@dataclass
class KeyUsage:
    """What a key's requests used, for /metrics (monotonic counters)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    rate_limited: int = 0


@dataclass
class Key:
    """An authenticated caller: a name, its limits' buckets and its usage."""

    name: str
    digest: bytes
    quota: KeyQuota
    usage: KeyUsage = field(default_factory=KeyUsage)


class Keyring:
    """The server's keys. `reload` re-reads the key file: a key that keeps its name keeps its buckets (under its
    new limits) and usage; requests in flight finish under the Key they started with."""

    def __init__(self, keys: list[str] | None = None, file: str | Path | None = None, clock: Clock = time.monotonic):
        self.flag_keys, self.file, self.clock = list(keys or []), file, clock
        self._keys: list[Key] = []
        self._usage: dict[str, KeyUsage] = {}  # every name ever served, so counters never go back
        self._anonymous = Key(ANONYMOUS, b"", KeyQuota(Limits(), clock))
        self._install(self._specs())

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def names(self) -> list[str]:
        return [k.name for k in self._keys]

    def _specs(self) -> list[KeySpec]:
        specs = flag_keys(self.flag_keys)
        if self.file is not None:
            from_file = load_key_file(self.file)
            if not from_file:  # an empty file must not open the server to everyone
                raise KeyFileError(f"{self.file}: no keys; add at least one [keys.NAME] table with key or key_sha256")
            specs += from_file
        return check_unique(specs, "--api-key and --api-keys-file together")

    def _install(self, specs: list[KeySpec]) -> None:
        current = {k.name: k for k in self._keys}
        keys = []
        for spec in specs:
            key = current.get(spec.name)
            if key is None:
                usage = self._usage.setdefault(spec.name, KeyUsage())
                key = Key(spec.name, spec.digest, KeyQuota(spec.limits, self.clock), usage)
            else:
                key.digest = spec.digest
                key.quota.update(spec.limits)
            keys.append(key)
        self._keys = keys

    def reload(self) -> None:
        """Re-read the key file; on any error the keys in use stay as they were (raises KeyFileError)."""
        self._install(self._specs())

    def identify(self, token: str) -> Key | None:
        """The Key whose key is `token` (every digest compared, so timing reveals nothing); None if none is.
        Without keys, everyone is the anonymous, unlimited Key."""
        if not self._keys:
            return self._anonymous
        given = hashlib.sha256(token.encode()).digest()
        found = None
        for key in self._keys:
            if hmac.compare_digest(given, key.digest):
                found = key
        return found

    def named(self, name: str) -> Key | None:
        """The Key called `name` now (the anonymous one on a server without keys); None if no such key."""
        if not self._keys:
            return self._anonymous if name == ANONYMOUS else None
        return next((k for k in self._keys if k.name == name), None)

    def usage(self) -> dict[str, KeyUsage]:
        """Usage by key name (the anonymous caller's only once it has sent a request)."""
        out = dict(self._usage)
        if self._anonymous.usage.requests or self._anonymous.usage.rate_limited:
            out[ANONYMOUS] = self._anonymous.usage
        return out


class BearerAuth:
    """FastAPI dependency: with keys set, a request needs `Authorization: Bearer <one of them>`. The request's Key
    is left in its scope for limits, rate-limit headers and usage."""

    def __init__(self, keys: Keyring | list[str]):
        self.keyring = keys if isinstance(keys, Keyring) else Keyring(keys)

    @property
    def enabled(self) -> bool:
        return self.keyring.enabled

    def __call__(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        key = self.keyring.identify(token.strip())
        if key is not None and self.keyring.enabled and scheme.lower() != "bearer":
            key = None
        if key is None:
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'")
        request.scope[SCOPE_KEY] = key
