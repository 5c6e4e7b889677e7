"""A free TCP port for a local server or a process group's store: the operating system's choice of an unused port,
bound on ``host`` (loopback by default, so nothing listens beyond this machine unless a caller asks)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
