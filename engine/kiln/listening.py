"""The sockets `kiln serve`, `kiln router` and the operator's endpoints listen on.

Without a host (or with "::"): one socket for both families (IPv6 taking IPv4 as mapped
addresses), so a pod answers on its pod IP whether the cluster is IPv4, IPv6 or dual-stack, and
port 0 gets one port for both (asyncio's host=None binds a socket per family, each on a port of its
own). A kernel without IPv6 gets IPv4 alone. A host name gets a socket per address it names
(`localhost` is often ::1 and 127.0.0.1), all on one port, as asyncio binds a name; an address this
machine cannot have (a pod's /etc/hosts names ::1 with IPv6 off) is left out if another binds."""
from __future__ import annotations

import errno
import socket

UNAVAILABLE = (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL)  # no such family, or no such address, here


def listening_sockets(host: str | None, port: int) -> list[socket.socket]:
    """Bound, listening TCP sockets on `host` (None or "": every address) and `port` (0: any free,
    the same for each); an OSError when none can be had or the port is taken, with none left open."""
    if not host:  # None or "" (as asyncio takes it)
        host = "::"
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = list(dict.fromkeys((family, proto, address) for family, _, proto, _, address in found))
    sockets: list[socket.socket] = []
    try:
        unavailable: OSError | None = None
        for family, proto, address in addresses:
            if sockets:  # port 0: the port the first one got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:  # a name's IPv6 address beside its IPv4 one takes IPv6 alone; "::" alone takes both
                sockets.append(_bound(family, proto, address, v6only=len(addresses) > 1))
            except OSError as err:
                if err.errno not in UNAVAILABLE:
                    raise
                unavailable = err
        if not sockets:
            raise unavailable or OSError(errno.EADDRNOTAVAIL, f"{host} names no address")
    except OSError as err:
        for sock in sockets:
            sock.close()
        if host == "::" and err.errno in UNAVAILABLE:  # no IPv6 in this kernel
            return listening_sockets("0.0.0.0", port)
        raise
    return sockets


def _bound(family: int, proto: int, address: tuple, v6only: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers do
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
