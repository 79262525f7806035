"""A tenant's prefix-cache salt. `kiln router` with API keys sends each key's salt in a header
(one a client sent is dropped there), and the engine joins it to the body's own `cache_salt`: the
router never parses or rewrites a body, which cost it many times the body's size in memory and
held its event loop while it did."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from kiln.engine.api_errors import APIError

HEADER = "X-Kiln-Cache-Salt"
MAX_TENANT = 128  # the router's are 32 hex digits


def joined(tenant: str | None, own: str | None) -> str | None:
    """The request's cache_salt: the tenant's, then the client's own as a digest (so it only
    splits the tenant's cache further, and the whole stays within the body field's 256)."""
    if tenant is None:
        return own
    if not tenant or len(tenant) > MAX_TENANT:
        raise APIError(400, f"the {HEADER} header must be 1 to {MAX_TENANT} characters")
    return tenant if not own else f"{tenant}:{hashlib.sha256(own.encode(errors='surrogatepass')).hexdigest()[:32]}"


def apply(req: Any, headers: Mapping[str, str]) -> None:
    """A parsed generation request's cache_salt, joined to the tenant's from the headers."""
    req.cache_salt = joined(headers.get(HEADER), req.cache_salt)
