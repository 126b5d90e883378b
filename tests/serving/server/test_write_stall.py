"""`WriteStall` on a real socket pair: a peer that stops reading is noticed after the timeout, one
that reads is not, and the kernel is asked at most every PROBE_EVERY_S (not once per record)."""

from __future__ import annotations

import socket

import pytest

from serving.server.write_stall import PROBE_EVERY_S, ClientNotReading, WriteStall


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _write(sock: socket.socket, stall: WriteStall, data: bytes) -> None:
    stall.check(len(data))
    sock.sendall(data)


def test_a_peer_that_stops_reading_is_cut_after_the_timeout_and_a_reading_one_is_not(monkeypatch):
    ours, peer = socket.socketpair()
    clock = _Clock()
    stall = WriteStall(ours, timeout=2.0, clock=clock)
    probes = []
    real = stall.unacknowledged
    monkeypatch.setattr(stall, "unacknowledged", lambda: probes.append(clock.now) or real())
    try:
        for _ in range(3):  # the peer reads everything: never a stall, however long it takes
            _write(ours, stall, b"x" * 100)
            peer.recv(1000)
            clock.now += 5.0
        for _ in range(20):  # now it stops reading: records keep coming every 0.1 s
            _write(ours, stall, b"y" * 100)
            clock.now += 0.1
        with pytest.raises(ClientNotReading):
            for _ in range(10):
                _write(ours, stall, b"z" * 100)
                clock.now += 0.1
        assert clock.now - 115.0 <= 2.0 + PROBE_EVERY_S + 0.1 + 1e-9  # cut within timeout + one probe period
        gaps = [b - a for a, b in zip(probes, probes[1:])]
        assert len(probes) < 3 + 30 and all(g >= PROBE_EVERY_S - 1e-9 for g in gaps[3:]), probes
    finally:
        ours.close()
        peer.close()
