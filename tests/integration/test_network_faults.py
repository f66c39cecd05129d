"""The network faults of ``tests/helpers/network.py`` do what they say, to real sockets on loopback, and leave
no rule behind: a loopback host sends from its own address, a partition cuts exactly the pairs it names, a
rate limit, a loss or a delay slows exactly the traffic of its host."""

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import REPO, network
from tests.helpers.tools import requires_root

pytestmark = requires_root

# Connects to HOST:PORT, sends SIZE bytes, prints the seconds until the server acknowledged them all, or "timeout".
_CLIENT = """
import socket, sys, time
started = time.monotonic()
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
        s.sendall(bytes(int(sys.argv[4])))
        s.shutdown(socket.SHUT_WR)
        assert s.recv(1) == b"k"
    print(time.monotonic() - started)
except OSError:
    print("timeout")
"""


class SinkServer:
    """Reads each connection to its end, then answers ``k``; remembers the source address of every connection.

    Each connection has its own thread: under loss a timed-out client's reset can be dropped, and a server
    reading connections one at a time would wait on that dead one forever and refuse every later client."""

    def __init__(self, address: str):
        self.sock = socket.create_server((address, 0))
        self.address, self.port = address, self.sock.getsockname()[1]
        self.sources: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, (source, _) = self.sock.accept()
            except OSError:
                return
            self.sources.append(source)
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    @staticmethod
    def _drain(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # a reset or an abort ends it too
            while conn.recv(1 << 20):
                pass
            conn.sendall(b"k")


@pytest.fixture
def hosts(tmp_path):
    """Three loopback hosts of this run's subnet (SNAT on), a sink server on the second, and
    ``connect(host, timeout, size)``: the seconds ``host`` took to send ``size`` bytes to it, None if it timed out."""
    subnet = network.run_subnet()
    one, two, three = f"{subnet}.2", f"{subnet}.3", f"{subnet}.4"
    client = tmp_path / "client.py"
    client.write_text(_CLIENT)
    server = SinkServer(two)

    def connect(host: str, timeout: float = 2.0, size: int = 5) -> float | None:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.helpers.network",
                "--host",
                host,
                str(client),
                two,
                str(server.port),
                str(timeout),
                str(size),
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            check=True,
        ).stdout.strip()
        return None if out == "timeout" else float(out)

    with network.loopback_hosts([one, two, three]):
        yield one, three, server, connect
    server.sock.close()


def _our_rules() -> str:
    tables = [
        subprocess.run(["iptables", "-w", "-t", t, "-S"], capture_output=True, text=True).stdout for t in ("nat", "raw")
    ]
    return "\n".join(line for t in tables for line in t.splitlines() if f"-{os.getpid()}-" in line)


def test_a_loopback_host_connects_from_its_own_address(hosts):
    one, three, server, connect = hosts
    assert connect(one) is not None
    assert server.sources == [one]


def test_a_partition_cuts_the_named_pair_both_ways_then_heals(hosts):
    one, three, server, connect = hosts
    with network.partition([one], [network.Endpoint(server.address, server.port)]):
        assert connect(one, timeout=1.0) is None
        assert connect(three, timeout=2.0) is not None  # another host still gets through
    assert connect(one) is not None
    assert server.sources == [three, one]


def test_a_rate_limit_slows_only_its_hosts_traffic_and_is_removed(hosts):
    one, three, server, connect = hosts
    payload = 4 * 1024 * 1024  # 33.6 Mbit: 4.2 s at 8 Mbit/s
    with network.rate_limited([one], rate_mbit=8):
        slow = connect(one, 30.0, payload)
        other = connect(three, 30.0, payload)
    after = connect(one, 30.0, payload)
    assert slow is not None and 3.5 < slow < 8.0, slow
    assert other is not None and other < 1.0 and after is not None and after < 1.0, (other, after)
    assert "7a31" not in subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout


def test_a_flow_limit_slows_only_its_host_to_that_server_one_way(hosts):
    one, three, server, connect = hosts
    payload = 4 * 1024 * 1024  # 33.6 Mbit: 4.2 s at 8 Mbit/s
    to_server = network.Endpoint(server.address, server.port)
    with network.rate_limited_flows([(one, to_server)], rate_mbit=8):
        slow = connect(one, 30.0, payload)
        other = connect(three, 30.0, payload)
    with network.rate_limited_flows([(to_server, one)], rate_mbit=8):  # the other way: only the acks, unshaped
        back = connect(one, 30.0, payload)
    assert slow is not None and 3.5 < slow < 8.0, slow
    assert other is not None and other < 1.0 and back is not None and back < 1.0, (other, back)
    assert "7a31" not in subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout


def test_loss_drops_about_its_share_of_packets_and_tcp_still_delivers(hosts):
    one, _, server, connect = hosts
    with network.lossy([one], loss_percent=50):
        answered = [connect(one, timeout=3.0) for _ in range(6)]
    assert any(a is None or a > 0.2 for a in answered), answered  # half the packets lost: retransmissions (>= 200 ms)
    assert connect(one) is not None and "LOSS" not in _our_rules()


def _echo(listener: socket.socket) -> None:
    """Sends back every byte each connection to ``listener`` sends, until it closes."""

    def serve(conn):
        with conn, contextlib.suppress(OSError):  # a reset ends it too
            while chunk := conn.recv(1 << 16):
                conn.sendall(chunk)

    while True:
        try:
            threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()
        except OSError:
            return


def _round_trip(conn: socket.socket) -> float:
    started = time.monotonic()
    conn.sendall(b"?")
    assert conn.recv(1) == b"?"
    return time.monotonic() - started


def test_a_delay_slows_each_round_trip_from_and_to_its_host_only(hosts):
    one, three, server, connect = hosts
    with network.delayed([one], milliseconds=50):
        outgoing = connect(one)
        others = [connect(three) for _ in range(3)]
    with network.delayed([server.address], milliseconds=50):
        incoming = connect(three)
    after = [connect(one) for _ in range(3)]
    # 50 ms each way: the request reaches the sink 50 ms late, its answer comes back 50 ms late.
    assert 0.1 <= outgoing < 1.0 and 0.1 <= incoming < 1.0, (outgoing, incoming)
    assert min(others) < 0.1 and min(after) < 0.1, (others, after)  # the best of three: the machine may be busy
    assert "DELAY" not in _our_rules()


def test_a_delayed_connection_keeps_its_bytes_in_order_and_outlives_the_delay_undelayed(hosts):
    _, three, _, _ = hosts
    listener = socket.create_server((three, 0))
    threading.Thread(target=_echo, args=(listener,), daemon=True).start()
    payload, received = os.urandom(8 << 20), bytearray()

    def receive(conn):
        while len(received) < len(payload) and (chunk := conn.recv(1 << 20)):
            received.extend(chunk)

    with network.delayed([three], milliseconds=50):
        conn = socket.create_connection((three, listener.getsockname()[1]), timeout=30)
        delayed_trip = _round_trip(conn)
        reader = threading.Thread(target=receive, args=(conn,))
        reader.start()
        conn.sendall(payload)  # more than the proxy holds back: it pushes back and carries on
        reader.join(30)
    after = min(_round_trip(conn) for _ in range(3))  # the connection is still forwarded, without delay
    conn.close()
    listener.close()
    assert received == payload
    assert delayed_trip >= 0.1 and after < 0.1, (delayed_trip, after)


def test_a_delay_resets_the_connections_already_open_but_those_it_keeps_open(hosts):
    _, three, _, _ = hosts
    listener, kept = socket.create_server((three, 0)), socket.create_server((three, 0))
    for server in (listener, kept):
        threading.Thread(target=_echo, args=(server,), daemon=True).start()
    opened = socket.create_connection((three, listener.getsockname()[1]), timeout=5)
    spared = socket.create_connection((three, kept.getsockname()[1]), timeout=5)
    assert _round_trip(opened) < 1.0 and _round_trip(spared) < 1.0
    with network.delayed([three], milliseconds=50, keep_open=[kept.getsockname()[1]]):
        with pytest.raises(OSError):  # reset: its owner reconnects, through the delay
            _round_trip(opened)
        assert _round_trip(spared) < 0.1  # open before, kept: not delayed
    for sock in (opened, spared, listener, kept):
        sock.close()


def test_no_rule_is_left_after_the_contexts_even_on_error(hosts):
    one, _, server, _ = hosts
    with pytest.raises(ZeroDivisionError):
        with (
            network.partition([one], [server.address]),
            network.lossy([one], 1),
            network.rate_limited([one], 100),
            network.delayed([one], 50),
        ):
            assert "CUT" in _our_rules() and "LOSS" in _our_rules() and "DELAY" in _our_rules()
            raise ZeroDivisionError
    assert (
        "CUT" not in _our_rules() and "LOSS" not in _our_rules() and "DELAY" not in _our_rules()
    )  # the SNAT of the fixture is still on
    assert "7a31" not in subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
