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



def test_a_port_handed_out_is_not_handed_out_again_before_anyone_binds_it():
    """Two engines and a gateway started by one process each ask for a port before any binds:
    they must not be given the same one (seen in CI: a KV-event port chosen twice)."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
