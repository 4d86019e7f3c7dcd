"""A TCP relay that a test can cut like a partition, and heal.

Cut, nothing passes either way and nothing is refused: bytes wait in the sockets'
buffers and new connections hang, as across a network that drops every packet. The
relay runs in the test's process (threads), on 127.0.0.1, and stops with close().
"""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.support.services import free_port

#: How often a relay's threads look at whether it was cut, healed or closed (seconds).
POLL = 0.1


class Relay:
    """Relays connections from ``self.port`` to ``target_port`` on 127.0.0.1."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.port = free_port()
        self._passing = threading.Event()
        self._passing.set()
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._mutex = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(POLL)
        threading.Thread(target=self._accept, name=f"relay-{self.port}", daemon=True).start()

    def cut(self) -> None:
        self._passing.clear()

    def heal(self) -> None:
        self._passing.set()

    def close(self) -> None:
        self._closed.set()
        self._passing.set()
        self._listener.close()
        with self._mutex:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _wait_passing(self) -> bool:
        """Wait while cut; False once closed."""
        while not self._passing.wait(POLL):
            pass
        return not self._closed.is_set()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._keep(client)
        if not self._wait_passing():
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        self._keep(upstream)
        for sock in (client, upstream):
            sock.settimeout(POLL)
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _keep(self, sock: socket.socket) -> None:
        with self._mutex:
            self._sockets.add(sock)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        """Copy ``source`` to ``sink`` while passing; end both at either's end."""
        try:
            while self._wait_passing():
                try:
                    data = source.recv(65536)
                except TimeoutError:
                    continue
                if not data or not self._wait_passing():
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
                with self._mutex:
                    self._sockets.discard(sock)
