"""Process helpers: free ports outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from flying import procs


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = procs._ephemeral_low()
    ports = [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(low - procs.PORT_SPAN <= p < low for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_skipped():
    taken = procs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        procs._offset = taken - (procs._ephemeral_low() - procs.PORT_SPAN)  # try the taken port next
        got = procs.free_port()
        assert got != taken and procs._ephemeral_low() - procs.PORT_SPAN <= got < procs._ephemeral_low()
