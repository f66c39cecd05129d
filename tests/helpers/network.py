"""Network faults between processes on loopback: partitions (iptables drops), lossy links (iptables
``statistic``), slow links (htb) and delayed links (a delaying proxy), scoped to the addresses and ports of one run so that other runs on the machine are untouched.

Every process on one machine sends from 127.0.0.1, whatever address it listens on, so a rule could not tell
one node agent's traffic from another's. A *loopback host* fixes that: a process started under
``python -m tests.helpers.network -m MODULE ... --listen HOST:PORT ...`` (``AS_HOST``, a
``NodeAgentProcess.wrapper``) carries the supplementary group ``int(HOST)``, and ``loopback_hosts`` SNATs
that group's connections to HOST. Its packets then leave from its own address, as on a real network, and
the faults below match addresses as they are on the wire: partitions and loss drop in ``raw PREROUTING``
(after the source NAT, before replies are translated back), rate limits shape ``lo``'s egress (the same
view). This kernel has no ``netem`` (nor ``prio``): a delay is a proxy instead (``delayed``), which the
node's connections are DNATed to.

Every rule lives in chains or ``tc`` handles of this process's own; each context manager removes what it
added on exit, on error too (``delayed``: once the connections it carries have ended), and never flushes or
edits rules it did not create. Needs root.
"""

import asyncio
import atexit
import contextlib
import dataclasses
import fcntl
import functools
import ipaddress
import os
import re
import runpy
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

AS_HOST = ["tests.helpers.network"]
"""``NodeAgentProcess.wrapper`` / ``LocalCluster(agent_wrapper=...)``: the agent runs as the loopback host it listens on."""

_LO = "lo"
_TC_ROOT = "7a31"  # the root htb qdisc of lo while any rate limit is on (hex handle)
_LO_LOCK = "/run/lock/mtc-test-lo-shaper.lock" if os.path.isdir("/run/lock") else "/tmp/mtc-test-lo-shaper.lock"


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """An address on loopback, and a port when only connections to that port are meant (a server that
    shares its address with other processes, like a coordinator on 127.0.0.1).

    Attributes:
      address: an IPv4 address in 127.0.0.0/8.
      port: a TCP port the endpoint listens on, or None for every packet from or to ``address``.
    """

    address: str
    port: int | None = None

    def __post_init__(self):
        if ipaddress.IPv4Address(self.address) not in ipaddress.IPv4Network("127.0.0.0/8"):
            raise ValueError(f"{self.address} is not a loopback address")

    @classmethod
    def of(cls, value: "Endpoint | str") -> "Endpoint":
        """``value`` itself, or ``"HOST"`` / ``"HOST:PORT"`` parsed."""
        if isinstance(value, Endpoint):
            return value
        address, _, port = value.partition(":")
        return cls(address, int(port) if port else None)


def run_subnet() -> str:
    """A /24 of 127.0.0.0/8 for this process's loopback hosts, e.g. ``127.83.41``: other runs (other pids)
    get another one, so an address rule of one run never meets another run's traffic."""
    pid = os.getpid()
    return f"127.{1 + pid % 254}.{pid // 254 % 256}"


def _run(command: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, input=stdin, capture_output=True, text=True, check=check)


def _iptables_restore(table: str, lines: list[str]) -> None:
    """Applies ``lines`` to ``table`` in one transaction, leaving every other rule as it is."""
    _run(["iptables-restore", "-w", "--noflush"], stdin="\n".join([f"*{table}", *lines, "COMMIT", ""]))


def _add_chain(table: str, hook: str, name: str, rules: list[str]) -> None:
    """Creates chain ``name`` in ``table`` holding ``rules`` (``iptables`` arguments after ``-A name``) and
    jumps to it from ``hook``, in one transaction."""
    _iptables_restore(table, [f":{name} - [0:0]", *(f"-A {name} {r}" for r in rules), f"-I {hook} -j {name}"])


def _unhook(table: str, hook: str, name: str) -> None:
    """Removes every jump from ``hook`` to ``name`` (should an interrupted start have added two)."""
    while not _run(["iptables", "-w", "-t", table, "-D", hook, "-j", name], check=False).returncode:
        pass


def _drop_chain(table: str, name: str) -> None:
    """Flushes and deletes chain ``name`` (nothing jumps to it any more)."""
    _run(["iptables", "-w", "-t", table, "-F", name], check=False)
    _run(["iptables", "-w", "-t", table, "-X", name], check=False)


@contextlib.contextmanager
def _own_chain(table: str, hook: str, name: str, rules: list[str]) -> Iterator[None]:
    """Chain ``name`` of ``rules``, jumped to from ``hook`` while the context lasts (``_add_chain``); removes
    the jump and the chain on exit."""
    try:
        _add_chain(table, hook, name, rules)
        yield
    finally:
        _unhook(table, hook, name)
        _drop_chain(table, name)


_chains = iter(range(1 << 30))
_chains_lock = threading.Lock()


def _chain_name(kind: str) -> str:
    """``MTC-<kind>-<pid>-<n>``: unique in this machine's tables (at most 28 characters)."""
    with _chains_lock:
        return f"MTC-{kind}-{os.getpid()}-{next(_chains)}"[:28]


@contextlib.contextmanager
def loopback_hosts(addresses: Iterable[str]) -> Iterator[None]:
    """SNATs the connections of every process started under ``AS_HOST`` with one of ``addresses`` to that
    address, while the context lasts. Start the processes inside it: a connection keeps the source it
    was opened with."""
    rules = [
        f"-m owner --gid-owner {int(ipaddress.IPv4Address(a))} --suppl-groups -j SNAT --to-source {a}"
        for a in addresses
    ]
    with _own_chain("nat", "POSTROUTING", _chain_name("SNAT"), rules):
        yield


def _pair_rules(one: Endpoint, other: Endpoint) -> list[str]:
    """Drops for the traffic ``one`` sends to ``other``: to its port and the replies from it (``other``
    has a port), or every packet from ``one``'s address to ``other``'s."""
    if other.port is None:
        return [f"-s {one.address} -d {other.address} -j DROP"]
    return [
        f"-p tcp -s {one.address} -d {other.address} --dport {other.port} -j DROP",
        f"-p tcp -s {other.address} --sport {other.port} -d {one.address} -j DROP",
    ]


@contextlib.contextmanager
def partition(side: Iterable[Endpoint | str], others: Iterable[Endpoint | str]) -> Iterator[None]:
    """Drops every packet between any of ``side`` and any of ``others``, both ways, while the context lasts.

    An endpoint with a port is reached only at that port: connections to it are cut, the rest of its
    address's traffic is not. Connections already open stall (nothing is reset), as behind a real partition.
    """
    side, others = [Endpoint.of(e) for e in side], [Endpoint.of(e) for e in others]
    rules = [r for a in side for b in others for r in (*_pair_rules(a, b), *_pair_rules(b, a))]
    with _own_chain("raw", "PREROUTING", _chain_name("CUT"), list(dict.fromkeys(rules))):
        yield


class _LoShaper:
    """The root htb qdisc of ``lo`` while any rate limit is on, shared by every process of the machine (the
    root is one per device): an ``flock`` orders the changes, and the classes in use are read from ``tc``,
    so one run's exit never removes the root under another's limits. Unclassified packets (``default 0``)
    pass htb's direct queue unshaped; each limit is a class of its own with u32 filters into it."""

    @staticmethod
    @contextlib.contextmanager
    def _machine_lock() -> Iterator[None]:
        with open(_LO_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            yield

    @staticmethod
    def _classes() -> set[int]:
        shown = _run(["tc", "class", "show", "dev", _LO]).stdout
        return {int(number, 16) for number in re.findall(rf"class htb {_TC_ROOT}:([0-9a-f]+) ", shown)}

    def add_class(self, rate_mbit: float, burst: int) -> int:
        """A new class of ``rate_mbit`` under the root (created if need be); returns its number."""
        with self._machine_lock():
            root = _run(["tc", "qdisc", "show", "dev", _LO, "root"]).stdout
            if f"qdisc htb {_TC_ROOT}:" not in root:
                if "qdisc noqueue" not in root:
                    raise RuntimeError(f"{_LO} has a root qdisc that is not ours, left alone: {root.strip()}")
                _run(["tc", "qdisc", "add", "dev", _LO, "root", "handle", f"{_TC_ROOT}:", "htb", "r2q", "1000"])
            number = min(set(range(1, 1 << 12)) - self._classes())
            _run(
                [
                    "tc",
                    "class",
                    "add",
                    "dev",
                    _LO,
                    "parent",
                    f"{_TC_ROOT}:",
                    "classid",
                    f"{_TC_ROOT}:{number:x}",
                    "htb",
                    "rate",
                    f"{rate_mbit}mbit",
                    "burst",
                    str(burst),
                    "cburst",
                    str(burst),
                ]
            )
            return number

    def remove_class(self, number: int) -> None:
        """Removes the class and its filters; the root too when no class is left."""
        with self._machine_lock():
            _run(["tc", "filter", "del", "dev", _LO, "parent", f"{_TC_ROOT}:", "pref", str(number)], check=False)
            _run(["tc", "class", "del", "dev", _LO, "classid", f"{_TC_ROOT}:{number:x}"], check=False)
            if not self._classes():
                _run(["tc", "qdisc", "del", "dev", _LO, "root", "handle", f"{_TC_ROOT}:"], check=False)


_lo = _LoShaper()


def _u32_matches(endpoint: Endpoint) -> list[list[str]]:
    """u32 matches for the packets from and to ``endpoint``."""
    port = [str(endpoint.port), "0xffff"] if endpoint.port is not None else []
    return [
        ["match", "ip", "src", f"{endpoint.address}/32", *(["match", "ip", "sport", *port] if port else [])],
        ["match", "ip", "dst", f"{endpoint.address}/32", *(["match", "ip", "dport", *port] if port else [])],
    ]


@contextlib.contextmanager
def _shaped(matches: Iterable[list[str]], rate_mbit: float) -> Iterator[None]:
    """The packets that any of the u32 ``matches`` (each a list of ANDed clauses) selects share one htb class of
    ``rate_mbit`` megabits per second (10^6 bit/s) on ``lo`` while the context lasts."""
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 / 100))  # 10 ms of the rate, at least one GSO packet on lo
    number = _lo.add_class(rate_mbit, burst)
    try:
        for match in matches:
            _run(
                [
                    "tc",
                    "filter",
                    "add",
                    "dev",
                    _LO,
                    "parent",
                    f"{_TC_ROOT}:",
                    "protocol",
                    "ip",
                    "pref",
                    str(number),
                    "u32",
                    *match,
                    "flowid",
                    f"{_TC_ROOT}:{number:x}",
                ]
            )
        yield
    finally:
        _lo.remove_class(number)


def rate_limited(endpoints: Iterable[Endpoint | str], rate_mbit: float) -> contextlib.AbstractContextManager[None]:
    """Every packet from or to ``endpoints`` shares one link of ``rate_mbit`` megabits per second (10^6 bit/s,
    both directions together) while the context lasts; other traffic on ``lo`` is not shaped (an htb class)."""
    return _shaped((match for e in endpoints for match in _u32_matches(Endpoint.of(e))), rate_mbit)


def _u32_flow(source: Endpoint, destination: Endpoint) -> list[str]:
    """One u32 match (its clauses ANDed) for the packets from ``source`` to ``destination``: their addresses, and
    the source or destination port where the endpoint has one."""
    match = ["match", "ip", "src", f"{source.address}/32", "match", "ip", "dst", f"{destination.address}/32"]
    if source.port is not None:
        match += ["match", "ip", "sport", str(source.port), "0xffff"]
    if destination.port is not None:
        match += ["match", "ip", "dport", str(destination.port), "0xffff"]
    return match


def rate_limited_flows(
    flows: Iterable[tuple[Endpoint | str, Endpoint | str]], rate_mbit: float
) -> contextlib.AbstractContextManager[None]:
    """The packets of every ``(source, destination)`` flow share one link of ``rate_mbit`` megabits per second
    (10^6 bit/s) while the context lasts: one way only, as one direction of a full-duplex link (the replies, and
    every other packet on ``lo``, are not shaped by it). A per-node link to one server is two of these: the node's
    address to the server's address and port, and the reverse.

    Unlike ``rate_limited``, a flow names both ends, so one host's traffic to one server can have a link of its own
    beside its traffic to others. A packet is shaped once: where two limits' flows overlap, the older one's applies.
    """
    return _shaped((_u32_flow(Endpoint.of(s), Endpoint.of(d)) for s, d in flows), rate_mbit)


@contextlib.contextmanager
def lossy(endpoints: Iterable[Endpoint | str], loss_percent: float) -> Iterator[None]:
    """Drops each packet from or to ``endpoints`` with a chance of ``loss_percent`` percent (0-100), at
    random and independently, while the context lasts (iptables ``statistic``; TCP retransmits)."""
    rules = []
    for endpoint in (Endpoint.of(e) for e in endpoints):
        port = "" if endpoint.port is None else f"-p tcp --{{}}port {endpoint.port} "
        for way in ("s", "d"):
            rules.append(
                f"-{way} {endpoint.address} {port.format(way)}-m statistic --mode random "
                f"--probability {loss_percent / 100:.6f} -j DROP"
            )
    with _own_chain("raw", "PREROUTING", _chain_name("LOSS"), rules):
        yield


_SO_ORIGINAL_DST = 80  # getsockopt(SOL_IP, ...): a DNATed connection's destination before the DNAT
_PROXY_MARK = 0x6D7463  # SO_MARK of the delaying proxies' own connections: the DNAT rules let them pass
_CHUNK = 64 * 1024
_CHUNKS_IN_FLIGHT = 64  # per direction of a connection: at most 4 MiB held back by the delay


async def _together(*steps) -> None:
    """Runs ``steps`` (coroutines or tasks) at once until all are done; the first to fail cancels the others."""
    tasks = [asyncio.ensure_future(s) for s in steps]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


class _DelayProxy:
    """A TCP proxy on 127.0.0.1 for connections DNATed to it: it opens each to its original destination
    (``SO_ORIGINAL_DST``) and forwards every chunk, each direction on its own, ``seconds`` after it arrived,
    in order, with at most ``_CHUNKS_IN_FLIGHT`` chunks held (then it stops reading: TCP back-pressure).
    The connection to the destination is opened ``seconds`` after the client's, as a delayed SYN would be.
    It runs an asyncio loop on a thread of its own.

    Args:
      seconds: the delay of each direction.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._connections = 0
        self._stopping = False
        self._then: Callable[[], None] = lambda: None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="delay-proxy", daemon=True)
        self._thread.start()
        started.wait()
        self.port = self._server.sockets[0].getsockname()[1]

    def _run(self, started: threading.Event) -> None:
        self._server = self._loop.run_until_complete(asyncio.start_server(self._forward, "127.0.0.1", 0))
        started.set()
        try:
            self._loop.run_forever()
            if tasks := asyncio.all_tasks(self._loop):  # the ended connections' cancelled steps
                for task in tasks:
                    task.cancel()
                self._loop.run_until_complete(asyncio.wait(tasks))
            self._loop.close()
        finally:
            self._then()

    def stop(self, then: Callable[[], None], wait_seconds: float = 5.0) -> None:
        """Takes no more connections and forwards the open ones without delay until they end; then the loop
        ends and calls ``then``. Waits up to ``wait_seconds`` for that: connections that outlive the wait (a
        training process's) keep being forwarded, on the daemon thread, and ``then`` runs after the last."""

        def close():
            self._stopping, self.seconds, self._then = True, 0.0, then
            self._server.close()
            self._stop_when_idle()

        self._loop.call_soon_threadsafe(close)
        self._thread.join(wait_seconds)
        if self._thread.is_alive():
            atexit.register(then)

    def _stop_when_idle(self) -> None:
        # On the next turn of the loop: a connection accepted on this one has started its _forward by then.
        self._loop.call_soon(lambda: self._stopping and not self._connections and self._loop.stop())

    async def _forward(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        writers, upstream = [client_writer], socket.socket()
        try:
            raw = client_writer.get_extra_info("socket").getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
            port, address = struct.unpack_from("!2xH4s", raw)
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, _PROXY_MARK)
            upstream.setblocking(False)
            arrivals = asyncio.Queue(_CHUNKS_IN_FLIGHT)
            reading = asyncio.ensure_future(
                self._read(client_reader, arrivals)
            )  # the client may send before the connect
            try:
                await asyncio.sleep(self.seconds)
                await self._loop.sock_connect(upstream, (socket.inet_ntoa(address), port))
                server_reader, server_writer = await asyncio.open_connection(sock=upstream)
            except BaseException:
                reading.cancel()
                raise
            writers.append(server_writer)
            await _together(reading, self._write(arrivals, server_writer), self._pipe(server_reader, client_writer))
        except Exception:  # a reset, a refused connect: the other end sees a reset
            for writer in writers:
                with contextlib.suppress(OSError):  # linger 0: close sends a reset, not an end of stream
                    writer.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                writer.transport.abort()
            if len(writers) == 1:
                upstream.close()  # not connected, or no transport took it
        finally:
            for writer in writers:
                writer.close()
            self._connections -= 1
            self._stop_when_idle()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        arrivals = asyncio.Queue(_CHUNKS_IN_FLIGHT)
        await _together(self._read(reader, arrivals), self._write(arrivals, writer))

    @staticmethod
    async def _read(reader: asyncio.StreamReader, arrivals: asyncio.Queue) -> None:
        """Queues each chunk with its arrival time, then ``b""`` for the end of the stream."""
        while chunk := await reader.read(_CHUNK):
            await arrivals.put((time.monotonic(), chunk))
        await arrivals.put((time.monotonic(), b""))

    async def _write(self, arrivals: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        """Writes each queued chunk ``seconds`` after its arrival; half-closes at the end of the stream."""
        while True:
            arrived, chunk = await arrivals.get()
            await asyncio.sleep(arrived + self.seconds - time.monotonic())
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()


@contextlib.contextmanager
def delayed(endpoints: Iterable[Endpoint | str], milliseconds: float, keep_open: Iterable[int] = ()) -> Iterator[None]:
    """Delays each direction of every TCP connection opened from or to ``endpoints`` by ``milliseconds``
    (a request's round trip takes at least twice that) while the context lasts.

    An iptables ``nat OUTPUT`` DNAT sends the new connections to a local proxy (``_DelayProxy``): those to
    an endpoint's address (and port, if it has one), and, for an endpoint without a port, those its
    loopback host's processes (``AS_HOST``) or sockets bound to its address open. The destination then
    sees them come from 127.0.0.1, so the address rules of ``lossy`` and ``rate_limited`` meet each byte
    once (on the leg between the endpoint and the proxy), but a ``partition`` does not cut a delayed
    connection. UDP is not delayed.

    The proxy can only take new connections: those already open from or to ``endpoints`` are reset when
    the context begins (``ss -K``), so that their owners reconnect, through it, as a pooled HTTP client
    would after a link fault; but for those with a port in ``keep_open``, which stay open and undelayed.
    Connections open when the context ends are forwarded without delay until they close; the DNAT rules,
    no longer jumped to, are deleted after the last (at the latest when this process exits).
    """
    endpoints = [Endpoint.of(e) for e in endpoints]
    proxy, chain = _DelayProxy(milliseconds / 1000), None
    try:
        to_proxy = f"-j DNAT --to-destination 127.0.0.1:{proxy.port}"
        rules = [f"-m mark --mark {_PROXY_MARK} -j RETURN"]
        for endpoint in endpoints:
            if endpoint.port is not None:
                rules.append(f"-p tcp -d {endpoint.address} --dport {endpoint.port} {to_proxy}")
                continue
            group = int(ipaddress.IPv4Address(endpoint.address))
            rules += [
                f"-p tcp -d {endpoint.address} {to_proxy}",
                f"-p tcp -s {endpoint.address} {to_proxy}",
                f"-p tcp -m owner --gid-owner {group} --suppl-groups {to_proxy}",
            ]
        chain = _chain_name("DELAY")
        _add_chain("nat", "OUTPUT", chain, rules)
        _reset_open(endpoints, keep_open)
        yield
    finally:
        # New connections go straight to their destination at once. The DNAT rules themselves are deleted only
        # once the proxy's last connection has ended: deleting them under a connection with bytes in flight
        # left it hanging (this kernel, nf_tables), where the end of a delay must leave it whole.
        if chain:
            _unhook("nat", "OUTPUT", chain)
        proxy.stop(then=functools.partial(_drop_chain, "nat", chain) if chain else lambda: None)


def _reset_open(endpoints: list[Endpoint], keep_open: Iterable[int]) -> None:
    """Destroys (``ss -K``: the peer gets a reset) every established TCP socket from or to ``endpoints``,
    but those with a local or remote port in ``keep_open``."""
    ways = []
    for e in endpoints:
        port = f" and {{}}port = :{e.port}" if e.port else ""
        ways += [f"( dst {e.address}{port.format('d')} )", f"( src {e.address}{port.format('s')} )"]
    kept = [f"and not ( sport = :{p} or dport = :{p} )" for p in keep_open]
    _run(["ss", "-K", "-t", "-n", "state", "established", f"( {' or '.join(ways)} )", *kept])


def main() -> None:
    """``python -m tests.helpers.network [--host HOST] (-m MODULE | SCRIPT) ARGS...``: runs MODULE (or SCRIPT)
    with ARGS as loopback host HOST (supplementary group ``int(HOST)``, see ``loopback_hosts``); without
    ``--host``, the host of its ``--listen HOST:PORT`` argument."""
    args = sys.argv[1:]
    host = args[1] if args[:1] == ["--host"] else None
    args = args[2:] if host else args
    if not args or (args[0] == "-m" and len(args) < 2) or (host is None and "--listen" not in args):
        sys.exit(
            "usage: python -m tests.helpers.network [--host HOST] (-m MODULE | SCRIPT) ... [--listen HOST:PORT ...]"
        )
    if host is None:
        host = args[args.index("--listen") + 1].rpartition(":")[0]
    os.setgroups([*os.getgroups(), int(ipaddress.IPv4Address(host))])
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
