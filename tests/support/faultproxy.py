"""A fault-injecting HTTP/1.1 proxy for the test S3 server (moto): object storage as it behaves under load.

Every S3 client of a test (s3fs in the test process, in Ray workers, in subprocesses) talks to the
proxy on 127.0.0.1 (AWS_ENDPOINT_URL); the proxy forwards each request to moto unless the seeded
schedule picks a fault for it:

- ``slowdown``: answered ``503 SlowDown`` without forwarding (nothing stored);
- ``error500``: answered ``500 InternalError`` without forwarding;
- ``reset``: forwarded (a PUT is stored), then the response is cut off mid-body and the connection
  reset (TCP RST);
- ``timeout``: forwarded, then the response is held for ``delay_s`` (past the client's read timeout)
  and the connection dropped;
- ``put_lost``: PUT only: the body is read and stored upstream, then the client gets ``500``: a PUT
  that fails after its body was sent.

Each request matching ``match`` (a regex over ``"METHOD /bucket/key?query"``) draws one uniform
number from ``random.Random(seed)``; the fault fractions cut [0, 1) in the order above (at most
``limit`` faults when it is set). botocore sends
``Expect: 100-continue`` on every PUT: the proxy answers ``100 Continue`` (or a fault status
before the body, closing the connection) so PUTs never stall. Requests and faults are counted by
kind (LIST, GET, HEAD, PUT, DELETE, POST) for the tests and ``bench/bench_scale.py``.

Test code only: it runs as threads of the test process, so a test switches faults on and off while
Ray workers keep their endpoint.
"""
from __future__ import annotations

import http.client
import random
import re
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

FAULT_KINDS = ("slowdown", "error500", "reset", "timeout", "put_lost")
_HOP = {"connection", "keep-alive", "expect", "transfer-encoding", "proxy-connection", "te", "upgrade"}
_ERROR_BODY = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
               '<RequestId>fault-proxy</RequestId></Error>')
_ANSWERS = {"slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
            "error500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
            "put_lost": (500, "Internal Server Error", "InternalError", "We encountered an internal error.")}


@dataclass(frozen=True)
class Faults:
    """A seeded fault schedule: the fraction of matching requests that get each fault (sum <= 1)."""

    slowdown: float = 0.0
    error500: float = 0.0
    reset: float = 0.0
    timeout: float = 0.0
    put_lost: float = 0.0
    match: str = ""  # regex searched in "METHOD /bucket/key?query"; "" = every request
    seed: int = 0
    delay_s: float = 3.0  # how long a ``timeout`` response is held (set it above the client's read timeout)
    limit: int = 0  # serve at most this many faults (0 = no limit)

    def __post_init__(self) -> None:
        rates = [getattr(self, k) for k in FAULT_KINDS]
        if min(rates) < 0 or sum(rates) > 1:
            raise ValueError(f"fault fractions must be >= 0 and sum to <= 1, got {dict(zip(FAULT_KINDS, rates))}")


NO_FAULTS = Faults()


def request_kind(method: str, target: str) -> str:
    """LIST for a bucket-level GET with a listing query (``list-type``, ``prefix``, ``delimiter``),
    else the method (GET, HEAD, PUT, DELETE, POST)."""
    parts = urlsplit(target)
    if method == "GET" and parts.path.strip("/").count("/") == 0 and re.search(
            r"(^|&)(list-type|prefix|delimiter)=", parts.query):
        return "LIST"
    return method


@dataclass
class Stats:
    """Requests by kind and faults served by kind since the last :meth:`FaultProxy.reset_stats`."""

    requests: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    @property
    def retries_forced(self) -> int:
        """Faults served: each one made the client retry (or give up) once."""
        return sum(self.faults.values())


class FaultProxy:
    """The proxy: ``FaultProxy(upstream_url)``, ``.endpoint``, ``.set_faults(Faults(...))``, ``.stats``,
    ``.reset_stats()``, ``.close()``."""

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._faults, self._rng = NO_FAULTS, random.Random(0)
        self.stats = Stats()
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                proxy._serve(self)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def set_faults(self, faults: Faults) -> None:
        """Switch to ``faults`` (its seed restarts the draw sequence)."""
        with self._lock:
            self._faults, self._rng = faults, random.Random(faults.seed)

    def reset_stats(self) -> Stats:
        """Return the counts so far and start new ones."""
        with self._lock:
            old, self.stats = self.stats, Stats()
        return old

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- one client connection ----------------------------------------------------------------

    def _draw(self, method: str, target: str) -> str | None:
        with self._lock:
            self.stats.requests[request_kind(method, target)] += 1
            f = self._faults
            if f is NO_FAULTS or (f.match and not re.search(f.match, f"{method} {target}")):
                return None
            if f.limit and self.stats.retries_forced >= f.limit:
                return None
            u, edge = self._rng.random(), 0.0
            for kind in FAULT_KINDS:
                edge += getattr(f, kind)
                if u < edge:
                    if kind == "put_lost" and method != "PUT":
                        return None
                    self.stats.faults[kind] += 1
                    return kind
            return None

    def _serve(self, h: socketserver.StreamRequestHandler) -> None:
        upstream: http.client.HTTPConnection | None = None
        try:
            while True:
                request = _read_head(h.rfile)
                if request is None:
                    return
                method, target, headers = request
                fault = self._draw(method, target)
                expect = _header(headers, "expect").lower() == "100-continue"
                if fault in ("slowdown", "error500") and expect:  # refused before the body: close
                    _send_error(h.wfile, fault, close=True)
                    return
                if expect:
                    h.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    h.wfile.flush()
                body = _read_body(h.rfile, headers)
                if fault in ("slowdown", "error500"):
                    _send_error(h.wfile, fault, close=False)
                    continue
                upstream, response = self._forward(upstream, method, target, headers, body)
                if fault == "reset":
                    h.wfile.write(response[:max(1, len(response) // 2)])
                    h.wfile.flush()
                    _reset(h.connection)
                    return
                if fault == "timeout":
                    time.sleep(self._faults.delay_s)
                    _reset(h.connection)
                    return
                if fault == "put_lost":
                    _send_error(h.wfile, fault, close=False)
                    continue
                h.wfile.write(response)
                h.wfile.flush()
        except (ConnectionError, OSError):
            return
        finally:
            if upstream is not None:
                upstream.close()

    def _forward(self, conn, method, target, headers, body):
        out = [(k, v) for k, v in headers if k.lower() not in _HOP and k.lower() != "content-length"]
        if body or method in ("PUT", "POST"):
            out.append(("Content-Length", str(len(body))))
        for attempt in (0, 1):  # a kept-alive upstream connection may have been closed by moto
            if conn is None:
                conn = http.client.HTTPConnection(*self.upstream, timeout=60)
            try:
                conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                for k, v in out:
                    conn.putheader(k, v)
                conn.endheaders(body or None)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                conn = None
                if attempt:
                    raise
        lines = [f"HTTP/1.1 {resp.status} {resp.reason}"]
        for k, v in resp.getheaders():
            if k.lower() in _HOP or (k.lower() == "content-length" and method != "HEAD"):
                continue
            lines.append(f"{k}: {v}")
        if method != "HEAD":
            lines.append(f"Content-Length: {len(data)}")
        if resp.will_close:
            conn.close()
            conn = None
        return conn, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if method == "HEAD" else data)


def _read_head(rfile) -> tuple[str, str, list[tuple[str, str]]] | None:
    line = rfile.readline(65537)
    while line in (b"\r\n", b"\n"):
        line = rfile.readline(65537)
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers = []
    while True:
        raw = rfile.readline(65537)
        if raw in (b"\r\n", b"\n", b""):
            return method, target, headers
        key, _, value = raw.decode("latin-1").partition(":")
        headers.append((key.strip(), value.strip()))


def _header(headers: list[tuple[str, str]], name: str) -> str:
    return next((v for k, v in headers if k.lower() == name), "")


def _read_body(rfile, headers: list[tuple[str, str]]) -> bytes:
    if "chunked" in _header(headers, "transfer-encoding").lower():
        out = bytearray()
        while True:
            size = int(rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return bytes(out)
            out += rfile.read(size)
            rfile.readline()
    length = int(_header(headers, "content-length") or 0)
    return rfile.read(length) if length else b""


def _send_error(wfile, fault: str, *, close: bool) -> None:
    status, reason, code, message = _ANSWERS[fault]
    body = _ERROR_BODY.format(code=code, message=message).encode()
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/xml", f"Content-Length: {len(body)}",
            "x-amz-request-id: fault-proxy"] + (["Connection: close"] if close else [])
    wfile.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    wfile.flush()


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dropped connection looks to the client."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
