"""Joining an existing cluster: which address, from where, and reaching it within a bounded wait.

Ray retries an address that does not answer for many minutes (``--address 127.0.0.1:1`` sat 821 s before a
``ConnectionError`` traceback) and answers a malformed one with a ``ValueError`` traceback. Here the address is
parsed first, its port must answer as a gRPC server does (HTTP/2 SETTINGS) before ``--connect-timeout`` runs
out, and ``ray.init`` is then bounded by the same wait (as far as Ray returns to Python: its own GCS waits can
add up to about half a minute); every failure is an ``InputError`` (exit 2) naming the address and whether it came from
``--address`` or ``$RAY_ADDRESS``.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pd_dflash.errors import InputError

#: Addresses Ray resolves itself: the latest cluster started on this machine (``ray start``).
AUTO = "auto"
#: How long a cluster address may take to answer, by default (``--connect-timeout``).
DEFAULT_CONNECT_TIMEOUT_S = 30.0
#: HTTP/2's client connection preface and an empty SETTINGS frame; a gRPC server answers with its SETTINGS.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS_FRAME = 0x4


@dataclass(frozen=True)
class Address:
    text: str
    #: Where the address came from: ``--address`` or ``RAY_ADDRESS``.
    source: str
    #: (host, port) to reach, or None for ``auto`` (Ray finds the cluster itself).
    endpoint: tuple[str, int] | None

    def describe(self) -> str:
        return f"the Ray cluster at {self.text!r} (from {self.source})"


def parse_address(text: str, source: str) -> Address:
    """``host:port``, ``[v6]:port``, ``ray://host:port`` or ``auto``; anything else is an InputError."""
    value = text.strip()
    if value == AUTO:
        return Address(text, source, None)
    rest = value.removeprefix("ray://")
    host, sep, port_text = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    problem = None
    if value.startswith(("http://", "https://")):
        problem = (
            "an http(s) address is a dashboard's (for `ray job submit`), not a cluster's; expected HOST:PORT of "
            "the head's GCS (for example 10.0.0.1:6379), ray://HOST:PORT or auto"
        )
    elif not sep or not host or any(c.isspace() or c in "/?#@" for c in host):
        problem = "expected HOST:PORT (for example 10.0.0.1:6379), ray://HOST:PORT or auto"
    elif not port_text.isdigit() or not 0 < int(port_text) < 65536:
        problem = f"the port must be a number from 1 to 65535, got {port_text!r}"
    if problem:
        raise InputError(f"malformed Ray cluster address {text!r}: {problem}", where=source)
    return Address(text, source, (host, int(port_text)))


def reach(address: Address, timeout_s: float) -> None:
    """Connect to the address's port and see a gRPC (HTTP/2) server answer, as a Ray GCS or Ray Client server
    does, retrying until ``timeout_s`` runs out: InputError naming the address when it never does."""
    if address.endpoint is None:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection(address.endpoint, timeout=max(0.1, min(5.0, left))) as sock:
                why = _grpc_answer(sock, deadline)
        except OSError as exc:
            why = f"does not answer: {exc.strerror or exc}"
        if why is None:
            return
        if time.monotonic() + 0.5 >= deadline:
            raise InputError(
                f"{address.describe()} {why} (waited {timeout_s:g} s). Check the address and that the cluster "
                "is up (`ray status` on its head), or raise --connect-timeout",
                where=address.source,
            )
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _grpc_answer(sock: socket.socket, deadline: float) -> str | None:
    """None when the peer answers HTTP/2's client preface with a SETTINGS frame (every gRPC server does), else
    what it did. Skipped with Ray's TLS on (``RAY_USE_TLS``): the handshake is TLS's then."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    sock.sendall(HTTP2_PREFACE + EMPTY_SETTINGS)
    head = b""
    while len(head) < 9:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            chunk = sock.recv(9 - len(head))
        except TimeoutError:
            return "accepted a connection but never answered as a Ray GCS (gRPC) would"
        if not chunk:
            return "accepted a connection and closed it without answering as a Ray GCS (gRPC) would"
        head += chunk
    if head[3] != SETTINGS_FRAME:
        return f"answered, but not as a Ray GCS (gRPC) would (first bytes {head[:9]!r})"
    return None


@contextlib.contextmanager
def bounded(address: Address, timeout_s: float) -> Iterator[None]:
    """Interrupt what runs inside (``ray.init``) once ``timeout_s`` is over, and turn that or Ray's own refusal
    into an InputError naming the address. Only in the main thread (the interrupt is delivered there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired, done, lock = threading.Event(), threading.Event(), threading.Lock()

    def interrupt() -> None:
        with lock:
            if not done.is_set():
                fired.set()
                _thread.interrupt_main()

    timer = threading.Timer(timeout_s, interrupt)
    timer.daemon = True
    timer.start()
    try:
        yield
        with lock:
            done.set()
        if fired.is_set():  # it joined just as the wait ran out: take the interrupt now, not later
            with contextlib.suppress(KeyboardInterrupt):
                time.sleep(0.05)
    except KeyboardInterrupt:
        if not fired.is_set():
            raise
        raise InputError(
            f"{address.describe()} accepted a connection but did not let this driver join within {timeout_s:g} s "
            "(is it a Ray head's GCS port?); raise --connect-timeout if the cluster is only slow",
            where=address.source,
        ) from None
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as exc:  # Ray's refusals
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise InputError(f"cannot join {address.describe()}: {line}", where=address.source) from None
    finally:
        timer.cancel()
