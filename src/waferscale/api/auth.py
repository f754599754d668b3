"""Bearer-key authentication: keys from --api-key or WAFERSCALE_API_KEY, compared in constant time."""

from __future__ import annotations

import hmac

from fastapi import Request

from waferscale.api.errors import APIError


def parse_keys(*sources: str | None) -> list[str]:
    """Comma-separated keys from each source, blanks dropped."""
    keys: list[str] = []
    for source in sources:
        if source:
            keys.extend(k.strip() for k in source.split(",") if k.strip())
    return keys


class BearerAuth:
    """FastAPI dependency: with keys set, a request needs `Authorization: Bearer <one of them>`."""

    def __init__(self, keys: list[str]):
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __call__(self, request: Request) -> None:
        if not self._keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        ok = False
        for key in self._keys:  # check every key so timing does not reveal which one matched
            ok |= hmac.compare_digest(given, key)
        if scheme.lower() != "bearer" or not ok:
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'")
