"""The watchdog ring's TCP sockets: options (keep-alive probes that find a lost machine), this process's address.

Used by :class:`~lightning_varuna.failstop.watchdog.Watchdog`.
"""

from __future__ import annotations

import contextlib
import os
import socket

__all__ = ["KEEPALIVE", "KEEPALIVE_S", "local_address", "tune"]

KEEPALIVE = (2, 1, 3)
"""TCP keep-alive: first probe after 2 s of silence, then every 1 s; 3 unanswered probes end the connection."""
KEEPALIVE_S = KEEPALIVE[0] + KEEPALIVE[1] * KEEPALIVE[2]
"""Seconds after which a neighbour whose machine vanished (no answer from its kernel) counts as dead."""


def tune(sock: socket.socket) -> None:
    """Blocking with a short timeout for sends, no Nagle delay, and keep-alive probes that find a lost machine."""
    sock.settimeout(2.0)
    options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1), (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    idle, interval, count = KEEPALIVE
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count),
                        ("TCP_USER_TIMEOUT", KEEPALIVE_S * 1000)):
        if hasattr(socket, name):  # Linux; elsewhere the system's keep-alive timing applies
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


def local_address() -> tuple[str, socket.AddressFamily]:
    """The address peers reach this process at: the one its route to ``MASTER_ADDR`` leaves from."""
    master = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(master, int(os.environ.get("MASTER_PORT", 1)),
                                                       type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # UDP: picks the route, sends nothing
            return probe.getsockname()[0], family
    except OSError:  # no route to it: the host's own name (raises if that does not resolve either)
        return socket.gethostbyname(socket.gethostname()), socket.AF_INET
