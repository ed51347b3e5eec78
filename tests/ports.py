"""Port helpers the network tests share (bind only; nothing is sent anywhere)."""

from __future__ import annotations

import socket


def free_block(size: int, start: int = 41000, stop: int = 60000) -> int:
    """The first of `size` consecutive TCP ports nothing on this host holds now."""
    for first in range(start, stop, size):
        socks = []
        try:
            for port in range(first, first + size):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {size} free consecutive ports in {start}-{stop}")


def http_get(host: str, port: int, path: str = "/", timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.0 GET: raw sockets, so no proxy setting can reroute it."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, body
