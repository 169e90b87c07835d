"""Destinations for the egress tests, each in a process of its own: the proxy refuses every port its own process
listens on (the broker's, in a test), so a server the test process ran would never be let through. On 127.0.0.1
only.

``python -m tests.egress_servers http NAME`` answers every GET with ``hello from NAME``; ``... echo`` sends back
what it reads; ``... files DIR`` serves the files under DIR (a package index, for pip). Each prints its port on its first line, then serves until killed.
"""

from __future__ import annotations

import contextlib
import functools
import socketserver
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer


def serve_http(name: str) -> None:
    class Hello(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"hello from {name} {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with ThreadingHTTPServer(("127.0.0.1", 0), Hello) as server:
        print(server.server_address[1], flush=True)
        server.serve_forever()


def serve_echo() -> None:
    class Echo(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            while data := self.request.recv(65536):
                self.request.sendall(data)

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo) as server:
        print(server.server_address[1], flush=True)
        server.serve_forever()


def serve_files(directory: str) -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SimpleHTTPRequestHandler, directory=directory)) \
            as server:
        print(server.server_address[1], flush=True)
        server.serve_forever()


@contextlib.contextmanager
def server(*args: str) -> Iterator[int]:
    """A server of this module in a subprocess, for the test's duration: its port."""
    process = subprocess.Popen([sys.executable, "-m", "tests.egress_servers", *args], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline())
    finally:
        process.kill()
        process.wait()


if __name__ == "__main__":
    if sys.argv[1] == "http":
        serve_http(sys.argv[2])
    elif sys.argv[1] == "files":
        serve_files(sys.argv[2])
    else:
        serve_echo()
