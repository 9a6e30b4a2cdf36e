"""What the tests' TCP proxies share: a listener on a free loopback port
that serves each accepted client in ``_serve``, and closing sockets
without caring whether the peer already went."""

from __future__ import annotations

import socket
import threading
from typing import Tuple

#: Bytes read at once.
CHUNK = 65536


class TcpProxy:
    """Listens on 127.0.0.1 (``url``) in front of ``upstream``; each
    accepted client is handed to ``_serve`` on a thread of its own."""

    def __init__(self, upstream: Tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self.listener.getsockname()[1]
        self._closed = False

    def start(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        raise NotImplementedError


def close_quietly(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
