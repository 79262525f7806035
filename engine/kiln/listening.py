"""The socket `kiln serve` and `kiln router` listen on. Without --host: one socket for both
families (IPv6 "::" taking IPv4 as mapped addresses), so a pod answers on its pod IP whether the
cluster is IPv4, IPv6 or dual-stack, and --port 0 gets one port for both (asyncio's host=None
binds a socket per family, each on a port of its own). A kernel without IPv6 gets IPv4 alone."""
from __future__ import annotations

import socket


def listening_socket(host: str | None, port: int) -> socket.socket:
    """A bound, listening TCP socket on `host` (None or "": every address) and `port` (0: any free);
    an OSError when it cannot be had (the port is taken, the address is not this machine's)."""
    if not host:  # None or "" (as asyncio takes it)
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError:  # no IPv6 in this kernel
            host = "0.0.0.0"
        else:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            return _bound(sock, ("::", port))
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    return _bound(socket.socket(family, kind, proto), address)


def _bound(sock: socket.socket, address: tuple) -> socket.socket:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers do
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
