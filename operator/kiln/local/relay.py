"""A TCP relay from the bridge gateway to the apiserver on loopback.

Pods of the local test runtime live in network namespaces whose loopback is their own, so
they reach the apiserver (which listens on 127.0.0.1 only) through this relay. TLS passes
through untouched; the apiserver's certificate already names the gateway address.
"""
from __future__ import annotations

import socket
import socketserver
import threading

BUFFER = 1 << 16


def pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(BUFFER):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class Relay:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        relay_target = target

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                with socket.create_connection(relay_target, timeout=10) as upstream:
                    upstream.settimeout(None)
                    back = threading.Thread(target=pipe, args=(upstream, self.request), daemon=True)
                    back.start()
                    pipe(self.request, upstream)
                    back.join()

        self.server = Server(listen, Handler)

    @property
    def address(self) -> tuple[str, int]:
        return self.server.server_address[:2]

    def start(self) -> None:
        threading.Thread(target=self.server.serve_forever, name="api relay", daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
