"""free_port: outside the ephemeral range, so a client's source port can never take it."""
import socket

from engines_adapters.net import _ephemeral_range, free_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    lo, _ = _ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # random, not one port handed to every caller
    for p in list(ports)[:10]:
        assert p < lo
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))

