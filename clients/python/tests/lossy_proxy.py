"""A TCP proxy in front of the real server that can lose one answer: the
request reaches the server and takes effect, the server's answer is
thrown away and the client's connection closed. That is the network
failure after which a write's outcome is unknown to the client."""

from __future__ import annotations

import socket
import threading
from typing import List, Tuple

from tcp_proxy import CHUNK, TcpProxy, close_quietly

#: How long the proxy waits for the server's answer it will drop.
ANSWER_TIMEOUT_S = 10.0


class LossyProxy(TcpProxy):
    def __init__(self, upstream: Tuple[str, int]) -> None:
        super().__init__(upstream)
        self._lose_next = threading.Event()
        #: The first line of every answer the proxy threw away.
        self.lost_answers: List[str] = []
        self.start()

    def lose_next_answer(self) -> None:
        """The next request to arrive (on any connection) reaches the
        server; its answer does not reach the client."""
        self._lose_next.set()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        state = {"lose": False}
        threading.Thread(target=self._to_server, args=(client, upstream, state), daemon=True).start()
        self._to_client(upstream, client, state)

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
            close_quietly(upstream)

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
            close_quietly(client)
            close_quietly(upstream)

