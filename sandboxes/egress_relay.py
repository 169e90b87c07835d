"""The sandbox's end of its egress proxy (``sandboxes/egress_proxy.py``): the sandbox has no network but its own
loopback, so something there must take its commands' proxy connections (``HTTP_PROXY`` names 127.0.0.1:PORT) and
carry each to the proxy's unix socket, bind-mounted read-only into the sandbox. It understands nothing of HTTP: the
node's proxy decides.

Shipped beside executor.py, which starts it in ``serve`` mode when given ``--egress PORT:SOCKET``; like it stdlib
only, for any python3 >= 3.8. One thread per connection, at most ``MAX_CONNECTIONS`` (the proxy allows as many).
"""

from __future__ import annotations

import selectors
import socket
import threading
import time

MAX_CONNECTIONS = 64
CHUNK_BYTES = 64 * 1024


def start(spec: str) -> threading.Thread:
    """Listen on 127.0.0.1:PORT for ``spec`` = ``PORT:SOCKET`` (before any command runs, so none can take the
    port) and relay in a daemon thread."""
    port, path = spec.split(":", 1)
    listener = socket.create_server(("127.0.0.1", int(port)))
    thread = threading.Thread(target=_accept, args=(listener, path), name="tangram-egress-relay", daemon=True)
    thread.start()
    return thread


def _accept(listener: socket.socket, path: str) -> None:
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
    while True:
        try:
            client, _ = listener.accept()
        except OSError:  # out of descriptors, say: wait rather than spin
            time.sleep(0.1)
            continue
        if not slots.acquire(blocking=False):
            client.close()
            continue
        threading.Thread(target=_relay, args=(client, path, slots), daemon=True).start()


def _relay(client: socket.socket, path: str, slots: threading.BoundedSemaphore) -> None:
    try:
        with client, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
            upstream.connect(path)
            _pump(client, upstream)
    except OSError:  # either side went away: the other is closed with it
        pass
    finally:
        slots.release()


def _pump(one: socket.socket, other: socket.socket) -> None:
    """Copy both ways until both sides have ended, passing each side's end on as a half close."""
    peers = {one: other, other: one}
    with selectors.DefaultSelector() as selector:
        for side in peers:
            selector.register(side, selectors.EVENT_READ)
        open_sides = len(peers)
        while open_sides:
            for key, _ in selector.select():
                source: socket.socket = key.fileobj  # type: ignore[assignment]
                data = source.recv(CHUNK_BYTES)
                if data:
                    peers[source].sendall(data)
                    continue
                selector.unregister(source)
                peers[source].shutdown(socket.SHUT_WR)
                open_sides -= 1
