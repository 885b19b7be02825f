"""A storage fault injector for tests and drills: an HTTP proxy in front of an S3 endpoint that
fails a share of the requests passing through it.

    with FaultyProxy("http://127.0.0.1:5000", fault_rate=0.2, seed=0) as proxy:
        ... storage.options.endpoint_url = proxy.url ...
    print(proxy.faults)   # {'503': 12, 'reset': 4, 'lost-reply': 5}

The faults are the ones S3 clients meet for real: a 503 SlowDown reply, a connection closed
before the request reached the server, and a connection closed after the server applied the
request but before the reply came back (so a retried PUT writes the same key twice). And, asked
for by name, "silent": a request taken and never answered (a store that hangs), its connection
held until the proxy closes; "500": an Internal Server Error (a server whose database is gone).
"""

from __future__ import annotations

import http.client
import random
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self
from urllib.parse import urlsplit

FAULTS = ("503", "reset", "lost-reply")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te", "trailer"}
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultyProxy:
    def __init__(self, target: str, fault_rate: float, seed: int = 0, faults: tuple[str, ...] = FAULTS):
        parts = urlsplit(target)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.fault_rate = fault_rate
        self.fault_kinds = faults
        self.faults: Counter[str] = Counter()
        self.requests = 0
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.closed = threading.Event()  # what a silent request waits for
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.closed.set()
        self._server.shutdown()
        self._server.server_close()

    def draw(self) -> str | None:
        """The fault for the next request, or None to pass it through."""
        with self._lock:
            self.requests += 1
            if self._random.random() >= self.fault_rate:
                return None
            fault = self._random.choice(self.fault_kinds)
            self.faults[fault] += 1
            return fault


def _handler_for(proxy: FaultyProxy) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_Relay,), {"proxy": proxy})


_INTERNAL_ERROR = b'{"detail": "Internal Server Error"}'


class _Relay(BaseHTTPRequestHandler):
    """One request: relayed to the proxy's target, or failed as the proxy draws."""

    protocol_version = "HTTP/1.1"
    proxy: FaultyProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def _answer(self, status: int, content_type: str, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _relay(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        fault = self.proxy.draw()
        if fault == "503":
            return self._answer(503, "application/xml", _SLOW_DOWN)
        if fault == "500":
            return self._answer(500, "application/json", _INTERNAL_ERROR)
        if fault == "silent":
            self.proxy.closed.wait()
        if fault in ("reset", "silent"):
            self.close_connection = True
            return None
        upstream = http.client.HTTPConnection(*self.proxy.target, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        upstream.request(self.command, self.path, body=body, headers=headers)
        reply = upstream.getresponse()
        payload = reply.read()
        upstream.close()
        if fault == "lost-reply":
            self.close_connection = True
            return None
        self.send_response(reply.status, reply.reason)
        for name, value in reply.getheaders():
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        # A HEAD reply announces the object's size without carrying it.
        length = reply.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(payload))
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)
        return None

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _relay
