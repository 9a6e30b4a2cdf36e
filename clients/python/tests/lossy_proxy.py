"""A TCP proxy in front of the real server that can lose one answer: the
request reaches the server and takes effect, the server's answer is
thrown away and the client's connection closed. That is the network
failure after which a write's outcome is unknown to the client."""

from __future__ import annotations

import socket
import threading
from typing import List, Tuple

#: Bytes read at once.
CHUNK = 65536
#: How long the proxy waits for the server's answer it will drop.
ANSWER_TIMEOUT_S = 10.0


class LossyProxy:
    def __init__(self, upstream: Tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self.listener.getsockname()[1]
        self._lose_next = threading.Event()
        #: The first line of every answer the proxy threw away.
        self.lost_answers: List[str] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_next_answer(self) -> None:
        """The next request to arrive (on any connection) reaches the
        server; its answer does not reach the client."""
        self._lose_next.set()

    def close(self) -> None:
        self._closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            state = {"lose": False}
            threading.Thread(target=self._to_server, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self._to_client, args=(upstream, client, state), daemon=True).start()

    def _to_server(self, client: socket.socket, upstream: socket.socket, state: dict) -> None:
        try:
            while True:
                data = client.recv(CHUNK)
                if not data:
                    break
                if self._lose_next.is_set():
                    self._lose_next.clear()
                    state["lose"] = True
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(upstream)

    def _to_client(self, upstream: socket.socket, client: socket.socket, state: dict) -> None:
        try:
            while True:
                data = upstream.recv(CHUNK)
                if not data:
                    break
                if state["lose"]:
                    self.lost_answers.append(data.split(b"\r\n", 1)[0].decode("latin-1"))
                    break  # drop it and hang up on the client
                client.sendall(data)
        except OSError:
            pass
        finally:
            _close(client)
            _close(upstream)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
