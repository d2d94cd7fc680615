"""``free_port`` hands out listening ports from below the kernel's ephemeral range, where outgoing connections
cannot take them between the pick and the child's bind."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rollout_ledger.cli.stack import servers


def _range_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    return str(path)


def test_ports_come_from_below_the_ephemeral_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "EPHEMERAL_RANGE_FILE", _range_file(tmp_path, "32768\t60999\n"))
    ports = [servers.free_port() for _ in range(50)]
    assert all(servers.LISTEN_PORTS_FROM <= p < 32768 for p in ports), ports
    assert len(set(ports)) == len(ports), "a port handed out twice"


class _Picks:
    """Stands in for the random picker: hands out the given ports in order."""

    def __init__(self, *ports: int) -> None:
        self.ports = list(ports)

    def randint(self, low: int, high: int) -> int:
        return self.ports.pop(0)


def test_a_port_someone_listens_on_or_handed_out_before_is_skipped(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "EPHEMERAL_RANGE_FILE", _range_file(tmp_path, "32768 60999"))
    with socket.socket() as held, socket.socket() as spare, socket.socket() as other_spare:
        held.bind(("127.0.0.1", 0))
        held.listen()
        spare.bind(("127.0.0.1", 0))
        other_spare.bind(("127.0.0.1", 0))
        taken, free, other = (s.getsockname()[1] for s in (held, spare, other_spare))
        spare.close()
        other_spare.close()
        monkeypatch.setattr(servers, "_pick", _Picks(taken, free))
        assert servers.free_port() == free
        monkeypatch.setattr(servers, "_pick", _Picks(free, taken, other))
        assert servers.free_port() == other  # free was handed out already, taken is listened on


@pytest.mark.parametrize("text", ["", "garbage", "1024 60999"])
def test_without_a_usable_range_the_kernel_picks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr(servers, "EPHEMERAL_RANGE_FILE", _range_file(tmp_path, text))
    port = servers.free_port()
    assert servers._bindable(port)


def test_a_missing_range_file_falls_back_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers, "EPHEMERAL_RANGE_FILE", "/nonexistent/ip_local_port_range")
    assert servers._listen_range() is None
    assert 0 < servers.free_port() < 65536
