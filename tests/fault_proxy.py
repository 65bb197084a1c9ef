"""A TCP proxy on loopback in front of an S3 endpoint that injects real network faults on demand.

A client pointed at `proxy.endpoint` talks to the server through it. The mode switches at any
time, from any thread, and applies per HTTP request (also on a kept-alive connection, so a
client's connection pool cannot dodge it); once its `times` are used up the proxy forwards again:

    with FaultProxy(server.endpoint) as proxy:
        proxy.status(503, times=2)          # the next 2 requests get a 503 SlowDown, not forwarded
        proxy.drop_after(1000, times=1)     # the next response longer than 1000 bytes is cut there
        proxy.refuse()                      # connections close at once, unanswered (until pass_through)
        proxy.pass_through()
        proxy.requests, proxy.connections   # counts, to assert that a client retried
        proxy.request_log                   # [(method, path, range header or None), ...]

Requests are found by reading the request stream's HTTP/1.1 framing (head, then a Content-Length
or chunked body); the response stream is forwarded as raw bytes. A client that pipelines
requests, or that sends no body after an `Expect: 100-continue` the server refused, can be
miscounted: botocore and s3fs do neither in practice.
"""

from __future__ import annotations

import socket
import threading
from contextlib import suppress
from http import HTTPStatus
from urllib.parse import urlsplit

S3_ERROR_CODES = {403: "AccessDenied", 404: "NoSuchKey", 500: "InternalError", 503: "SlowDown"}
CHUNK = 1 << 16


def error_response(code: int, method: str, path: str) -> bytes:
    """An S3-style error reply that closes the connection (a HEAD reply carries no body)."""
    s3_code = S3_ERROR_CODES.get(code, "InternalError")
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{s3_code}</Code><Message>injected by tests/fault_proxy.py</Message>"
        f"<Resource>{path}</Resource><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")
    return head if method == "HEAD" else head + body


class _Reader:
    """Buffered reads from the client socket, handing every byte read to `sink` (the upstream, or nothing)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, b""

    def _fill(self) -> bool:
        data = self.sock.recv(CHUNK)
        self.buffer += data
        return bool(data)

    def head(self) -> bytes | None:
        """The next request head (through the blank line), or None at a clean end of the stream."""
        while b"\r\n\r\n" not in self.buffer:
            if not self._fill():
                return None
        end = self.buffer.index(b"\r\n\r\n") + 4
        head, self.buffer = self.buffer[:end], self.buffer[end:]
        return head

    def line(self, sink) -> bytes:
        while b"\r\n" not in self.buffer:
            if not self._fill():
                raise ConnectionError("request body ended early")
        end = self.buffer.index(b"\r\n") + 2
        line, self.buffer = self.buffer[:end], self.buffer[end:]
        sink(line)
        return line

    def exactly(self, n: int, sink) -> None:
        while n > 0:
            if not self.buffer and not self._fill():
                raise ConnectionError("request body ended early")
            piece, self.buffer = self.buffer[:n], self.buffer[n:]
            sink(piece)
            n -= len(piece)

    def body(self, headers: dict[str, str], sink) -> None:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size = int(self.line(sink).split(b";")[0].strip(), 16)
                if size == 0:
                    while self.line(sink) != b"\r\n":  # trailers, then the blank line
                        pass
                    return
                self.exactly(size + 2, sink)
        self.exactly(int(headers.get("content-length", "0") or 0), sink)


class FaultProxy:
    """Threaded proxy from `127.0.0.1:<free port>` to `upstream` (`http://host:port`)."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._lock = threading.Lock()
        self._mode, self._arg, self._times = "pass", 0, None
        self.requests = 0  # request heads seen, answered by the proxy or not
        self.connections = 0  # client connections accepted
        self.injected = 0  # requests answered, cut or refused by a fault
        self.request_log: list[tuple[str, str, str | None]] = []
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept_loop)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- modes ----------------------------------------------------------------------------------

    def _set(self, mode: str, arg: int = 0, times: int | None = None) -> None:
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1 or None (until changed), got {times}")
        with self._lock:
            self._mode, self._arg, self._times = mode, arg, times

    def pass_through(self) -> None:
        """Forward everything (the initial mode)."""
        self._set("pass")

    def status(self, code: int = 503, times: int | None = 1) -> None:
        """Answer the next `times` requests with `code` and an S3 error body (503: SlowDown), not forwarded."""
        self._set("status", code, times)

    def drop_after(self, n_bytes: int, times: int | None = 1) -> None:
        """Forward requests, and cut the next `times` responses longer than `n_bytes` (status line and
        headers included) after their first `n_bytes`, closing the connection: a short read. Shorter
        responses (a HEAD, a small GET) pass whole and use up nothing."""
        self._set("drop", n_bytes, times)

    def refuse(self, times: int | None = None) -> None:
        """Close new connections at once, and kept-alive ones at their next request, unanswered."""
        self._set("refuse", 0, times)

    @property
    def mode(self) -> str:
        with self._lock:
            return self._mode

    def reset_counts(self) -> None:
        with self._lock:
            self.requests = self.connections = self.injected = 0
            self.request_log.clear()

    def _take(self, counts_as_request: bool, method: str = "", path: str = "", range_: str | None = None):
        """The fault for this connection or request: (mode, arg). A `status` or `refuse` uses up one
        of its `times` here; a `drop` only when a response really is cut (`_claim_cut`)."""
        with self._lock:
            if counts_as_request:
                self.requests += 1
                self.request_log.append((method, path, range_))
            mode, arg = self._mode, self._arg
            if mode == "pass" or (mode != "refuse" and not counts_as_request):
                return "pass", 0
            if mode != "drop":
                self._use_one()
            return mode, arg

    def _use_one(self) -> None:
        """Count one injected fault and use up one of the mode's `times` (the lock is held)."""
        self.injected += 1
        if self._times is not None:
            self._times -= 1
            if self._times == 0:
                self._mode, self._arg, self._times = "pass", 0, None

    def _claim_cut(self) -> bool:
        """Whether a response may be cut now: `drop` is still on (no other connection used its last time)."""
        with self._lock:
            if self._mode != "drop":
                return False
            self._use_one()
            return True

    # --- plumbing -------------------------------------------------------------------------------

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _shut(self, *socks: socket.socket | None) -> None:
        for sock in socks:
            if sock is None:
                continue
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with suppress(OSError):
                sock.close()
            with self._lock:
                self._sockets.discard(sock)

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self.connections += 1
            self._track(client)
            if self._take(counts_as_request=False)[0] == "refuse":
                self._shut(client)
            else:
                self._spawn(self._serve, client)

    def _serve(self, client: socket.socket) -> None:
        """Read requests from `client`; forward them, answer them, or cut them, as the mode says."""
        upstream: socket.socket | None = None
        state = {"budget": None}  # response bytes left before the cut, for the current request
        reader = _Reader(client)
        try:
            while (head := reader.head()) is not None:
                lines = head.decode("latin-1").split("\r\n")
                method, path = (lines[0].split(" ") + ["", ""])[:2]
                fields = (line.partition(":") for line in lines[1:] if line)
                headers = {name.strip().lower(): value.strip() for name, _, value in fields}
                mode, arg = self._take(True, method, path, headers.get("range"))
                if mode == "refuse":
                    return
                if mode == "status":
                    if "100-continue" not in headers.get("expect", "").lower():
                        reader.body(headers, lambda _: None)  # read it, so the client is not cut mid-send
                    client.sendall(error_response(arg, method, path))
                    return
                if upstream is None:
                    try:
                        upstream = socket.create_connection(self.upstream, timeout=10)
                    except OSError:
                        return  # the server is down: the client sees its connection closed
                    upstream.settimeout(None)
                    self._track(upstream)
                    self._spawn(self._pump, upstream, client, state)
                with self._lock:
                    state["budget"] = arg if mode == "drop" else None
                upstream.sendall(head)
                reader.body(headers, upstream.sendall)
        except (OSError, ValueError):
            pass
        finally:
            self._shut(client, upstream)

    def _pump(self, upstream: socket.socket, client: socket.socket, state: dict) -> None:
        """Server -> client; a response longer than the current request's budget is cut at the budget
        and both connections closed (a response that fits is forwarded whole and uses up nothing)."""
        try:
            while data := upstream.recv(CHUNK):
                with self._lock:
                    budget = state["budget"]
                if budget is not None and len(data) > budget:
                    if self._claim_cut():
                        client.sendall(data[:budget])
                        return
                    budget = None
                with self._lock:
                    state["budget"] = None if budget is None else budget - len(data)
                client.sendall(data)
        except OSError:
            pass
        finally:
            self._shut(client, upstream)

    def close(self) -> None:
        """Stop accepting, close every open connection, and wait for the threads (a few seconds at most)."""
        if self._closed:
            return
        self._closed = True
        self._shut(self._listener)
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        self._shut(*sockets)
        for thread in threads:
            thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
