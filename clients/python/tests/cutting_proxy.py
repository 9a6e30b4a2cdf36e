"""A TCP proxy on the client's side of an event stream that cuts it: for
the next ``cuts`` connections that carry ``GET .../events``, it forwards
a random number of the answer's bytes (mid-event, mid-line, anywhere) and
then closes the client's connection and its own to the server. Other
requests pass through untouched."""

from __future__ import annotations

import random
import socket
import threading
from typing import List, Tuple

from tcp_proxy import CHUNK, TcpProxy, close_quietly


class CuttingProxy(TcpProxy):
    def __init__(self, upstream: Tuple[str, int], cuts: int, max_bytes: int, rng: random.Random) -> None:
        super().__init__(upstream)
        self._rng = rng
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._cuts_left = cuts
        #: Bytes each cut connection delivered before it was closed.
        self.cut_after: List[int] = []
        self.start()

    @property
    def cuts(self) -> int:
        with self._lock:
            return len(self.cut_after)

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        head = b""
        try:
            while b"\r\n" not in head:
                data = client.recv(CHUNK)
                if not data:
                    return
                head += data
            budget = None
            if head.startswith(b"GET ") and b"/events" in head.split(b"\r\n", 1)[0]:
                with self._lock:
                    if self._cuts_left > 0:
                        self._cuts_left -= 1
                        budget = self._rng.randint(1, self._max_bytes)
            upstream.sendall(head)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            sent = 0
            while True:
                data = upstream.recv(CHUNK)
                if not data:
                    break
                if budget is not None and sent + len(data) >= budget:
                    client.sendall(data[: budget - sent])
                    with self._lock:
                        self.cut_after.append(budget)
                    break
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            close_quietly(client)
            close_quietly(upstream)

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while True:
                data = client.recv(CHUNK)
                if not data:
                    break
                upstream.sendall(data)
        except OSError:
            pass

