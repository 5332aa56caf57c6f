"""Whether a local port is free: the check `sluice up` makes before it starts its children, and the one a sidecar
worker makes before it binds its shared gRPC port."""

from __future__ import annotations

import socket


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port. A plain bind (no SO_REUSEPORT) fails against any listener, a sluice
    worker's too, so a real port conflict is reported even where the ext_proc socket shares its port with a
    replacement worker (server.py)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
