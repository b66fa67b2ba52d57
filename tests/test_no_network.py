"""The guard in conftest keeps tests off the network: loopback works, anything else fails fast."""

from __future__ import annotations

import socket
import threading

import pytest


def test_a_connection_off_the_machine_is_refused():
    with socket.socket() as sock, pytest.raises(OSError, match="tests may not reach the network"):
        sock.connect(("192.0.2.1", 443))  # TEST-NET-1: never routed
    with pytest.raises(OSError, match="tests may not look up '192.0.2.1'"):
        socket.create_connection(("192.0.2.1", 443), timeout=30)
    with pytest.raises(OSError, match="tests may not look up 'example.org'"):
        socket.create_connection(("example.org", 443), timeout=30)
    with socket.socket() as sock:
        assert sock.connect_ex(("192.0.2.1", 80)) != 0


def test_loopback_still_works():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        accepted = []
        thread = threading.Thread(target=lambda: accepted.append(server.accept()[0]))
        thread.start()
        with socket.create_connection(("localhost", port), timeout=30):
            thread.join(30)
        assert len(accepted) == 1
        accepted[0].close()
