"""Where the goodput bench's tiers sit (``tests/bench/goodput.py``, ``torch_vs_nvrx``): the object store's and the
peers' bandwidth per node, as the bench's loopback links shape them (``tests/helpers/network.py``).

- ``realistic``: every node's traffic to the object store passes a link of its own, each way, at the model's
  STORE_BW per host scaled from its TARGET_BYTES per host to the bench's bytes per node (``scaled_bandwidth``: a full
  save or restore takes as long as the real one, 21 s); what a node's agent sends (its peers) passes a link at
  NEAR_BW scaled the same way.
- ``loopback``: the same paths unlimited: the object store (fake-gcs-server on loopback) as fast as RAM.

How a node's traffic is told apart on ``lo``: each node reaches the object store through a fake-gcs-server of its
own (``StoreFronts``: one per node, all on one directory, so they serve the same bucket), so the store's side of
every packet names the node by its port, whichever way it goes and whatever address the client sends from. Our agents
run as loopback hosts (``network.AS_HOST``): what one sends leaves from its node's address.
"""

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

from tests.bench.goodput_model import NEAR_BW, SOURCES, STORE_BW, TARGET_BYTES, scaled_bandwidth
from tests.helpers import network
from tests.helpers.servers import FakeGcsServer

STORE_HOST = "127.0.0.1"  # the object store's address: fake-gcs-server listens there


@dataclasses.dataclass(frozen=True)
class Regime:
    """One regime's links.

    Attributes:
      name: ``realistic`` or ``loopback``.
      store: bytes/s per node to and from the object store (each way), or None: unlimited.
      near: bytes/s a node sends its peers, or None: unlimited.
    """

    name: str
    store: float | None = None
    near: float | None = None

    @classmethod
    def realistic(cls, bytes_per_node: float) -> "Regime":
        """The model's bandwidths per host carried to ``bytes_per_node`` (``scaled_bandwidth``)."""
        return cls("realistic", scaled_bandwidth(STORE_BW, bytes_per_node), scaled_bandwidth(NEAR_BW, bytes_per_node))

    def upload_seconds(self, upload_bytes: float) -> float:
        """How long a node takes to upload ``upload_bytes`` to the object store here (0 when unlimited)."""
        return upload_bytes / self.store if self.store else 0.0

    def describe(self, bytes_per_node: float) -> str:
        """The limits and what they stand for, with their source."""
        if self.store is None:
            return f"{self.name}: no limit; the object store (fake-gcs-server on loopback) and the peers as fast as RAM"
        peers = (
            f"peers {self.near / 2**20:.2f} MiB/s ({_mbit(self.near):.1f} Mbit/s) sent per node"
            if self.near
            else "peers not limited"
        )
        return (
            f"{self.name}: object store {self.store / 2**20:.2f} MiB/s ({_mbit(self.store):.1f} Mbit/s) per node each "
            f"way, {peers}: {bytes_per_node / 2**20:.0f} MiB per node standing for {TARGET_BYTES / 1e9:.2f} GB per host "
            f"at {STORE_BW / 1e9:.2f} GB/s through the store ({TARGET_BYTES / STORE_BW:.0f} s a full save or restore)"
            + (f" and {NEAR_BW / 1e9:.0f} GB/s from a peer ({TARGET_BYTES / NEAR_BW:.1f} s)" if self.near else "")
            + f"; {SOURCES}"
        )

    @contextlib.contextmanager
    def links(self, store_ports: list[int], agent_hosts: Sequence[str] = ()) -> Iterator[None]:
        """Shapes node ``i``'s links while the context lasts: its traffic to its store front at ``store_ports[i]``
        and back, and what the agent on loopback host ``agent_hosts[i]`` sends (but to the store: the store's links
        come first, and a packet is shaped once)."""
        with contextlib.ExitStack() as stack:
            local = STORE_HOST  # where the clients send from: a plain process, or (de-NATed) a loopback host's
            for index, port in enumerate(store_ports if self.store else []):
                front = network.Endpoint(STORE_HOST, port)
                sources = [local, *(agent_hosts[index : index + 1])]
                stack.enter_context(network.rate_limited_flows([(s, front) for s in sources], _mbit(self.store or 0)))
                stack.enter_context(network.rate_limited_flows([(front, local)], _mbit(self.store or 0)))
            for host in agent_hosts if self.near else []:
                # A push leaves from the host's address (its source NAT); a peer's read is answered from its listening
                # address, to the reader's 127.0.0.1 (the reply de-NATed before lo sees it).
                flows = [(host, other) for other in [local, *agent_hosts] if other != host]
                stack.enter_context(network.rate_limited_flows(flows, _mbit(self.near or 0)))
            yield


class StoreFronts:
    """One fake-gcs-server per node, all on one data directory (one bucket, seen alike through each), and one more
    for the bench's own calls (``admin``), none shaped: a node's store traffic is told apart by its front's port.

    Args:
      binary: the fake-gcs-server executable.
      data_dir: the objects' directory.
      nodes: how many fronts.
    """

    def __init__(self, binary: str, data_dir: str, nodes: int):
        self.admin = FakeGcsServer(binary, data_dir=data_dir)
        self.fronts = [FakeGcsServer(binary, data_dir=data_dir) for _ in range(nodes)]

    def start(self) -> "StoreFronts":
        for server in [self.admin, *self.fronts]:
            server.start()
        return self

    def stop(self) -> None:
        for server in [self.admin, *self.fronts]:
            server.stop()

    @property
    def ports(self) -> list[int]:
        return [front.port for front in self.fronts]

    def url(self, node: int) -> str:
        """Node ``node``'s store URL (``http://127.0.0.1:<port>``)."""
        return self.fronts[node].url


def _mbit(bytes_per_second: float) -> float:
    return bytes_per_second * 8 / 1e6


LOOPBACK = Regime("loopback")
