"""What of a client's request goes on to a replica, and what of the replica's response comes
back: the end-to-end headers, and a path only without '.' or '..' segments."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from kiln.engine import cache_salt

# Per-connection headers (RFC 9110 7.6.1) and ones the client library sets itself.
HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
    "Trailer", "Transfer-Encoding", "Upgrade", "Host"))
# The client library sets the length of what it sends, and the router's server has already
# decoded a compressed request body: forwarded, the encoding would make the replica decode
# plain bytes again and refuse them.
NOT_FORWARDED = HOP_BY_HOP | {"content-length", "content-encoding"}


def request_headers(headers: Mapping[str, str], salt: str | None = None) -> list[tuple[str, str]]:
    """Pairs, not a dict: a header may repeat. `salt`: the tenant's prefix-cache salt, in the
    header no client may set itself (one sent is dropped, with API keys or without)."""
    dropped = NOT_FORWARDED | _named_in_connection(headers) | {cache_salt.HEADER.lower()}
    return [(k, v) for k, v in headers.items() if k.lower() not in dropped] + \
        ([(cache_salt.HEADER, salt)] if salt else [])


def response_headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The response's bytes pass through untouched, so its length and encoding stay. A header
    whose value is not UTF-8 is left out, not changed (see header_not_utf8): the answer, its
    generation done, matters more than a header."""
    dropped = HOP_BY_HOP | _named_in_connection(headers)
    return [(k, v) for k, v in headers.items() if k.lower() not in dropped and _is_utf8(v)]


def header_not_utf8(headers: Iterable[tuple[str, str]]) -> str | None:
    """The name of the first header whose value is not UTF-8, if any. aiohttp reads such bytes
    (latin-1, say) as lone surrogates, which its writer cannot send as they came: the C writer
    drops them (an X-Request-Id would reach the replica changed), the Python one raises (a 500)."""
    return next((name for name, value in headers if not _is_utf8(value)), None)


def _is_utf8(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:  # a surrogate: a byte that was not UTF-8
        return False
    return True


def _named_in_connection(headers: Mapping[str, str]) -> frozenset[str]:
    """Headers the Connection header names are per-connection too (RFC 9110 7.6.1)."""
    getall = getattr(headers, "getall", None)
    values = getall("Connection", []) if getall else [headers.get("Connection", "")]
    return frozenset(name.strip().lower() for value in values for name in value.split(",") if name.strip())


def has_dot_segment(path: str) -> bool:
    """Whether a path (percent-decoded) has a '.' or '..' segment. The client library resolves
    those before sending, so /v1/../sleep would reach the engine's /sleep: a route no client of
    the router may use."""
    return any(segment in (".", "..") for segment in path.split("/"))
