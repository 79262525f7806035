"""The sockets `kiln serve`, `kiln router` and the operator's endpoints listen on.

Without a host: one socket for both families (IPv6 "::" taking IPv4 as mapped addresses), so a
pod answers on its pod IP whether the cluster is IPv4, IPv6 or dual-stack, and port 0 gets one
port for both (asyncio's host=None binds a socket per family, each on a port of its own). A kernel
without IPv6 gets IPv4 alone. With a host: a socket per address it names (`localhost` is often
::1 and 127.0.0.1), all on one port, as asyncio binds a name."""
from __future__ import annotations

import socket


def listening_sockets(host: str | None, port: int) -> list[socket.socket]:
    """Bound, listening TCP sockets on `host` (None or "": every address) and `port` (0: any free,
    the same for each); an OSError when one cannot be had (the port is taken, the address is not
    this machine's), with none left open."""
    if not host:  # None or "" (as asyncio takes it)
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError:  # no IPv6 in this kernel
            host = "0.0.0.0"
        else:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            return [_bound(sock, ("::", port))]
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = list(dict.fromkeys((family, proto, address) for family, _, proto, _, address in found))
    sockets: list[socket.socket] = []
    try:
        for family, proto, address in addresses:
            if sockets:  # port 0: the port the first one got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock = socket.socket(family, socket.SOCK_STREAM, proto)
            if family == socket.AF_INET6:  # its IPv4 twin, if named, has a socket of its own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sockets.append(_bound(sock, address))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


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
