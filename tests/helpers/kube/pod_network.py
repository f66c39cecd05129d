"""The network of ``make e2e-deploy``'s cluster, what a real cluster has and the chart's pods need: pod IPs (CNI's
ptp and host-local plugins, ``DeployNode``), Services routed by kube-proxy (its iptables rules), cluster DNS
(CoreDNS, behind the ``kube-dns`` Service).

All of it lives in a network namespace of the test's own (the Makefile's ``unshare --net``), so no address, route or
iptables rule reaches this machine's own network: the API server and the nodes have addresses of ``NODE_NETWORK`` on
its loopback interface (this kernel has no dummy interfaces), the pods of ``POD_NETWORK`` on ptp links. kube-proxy and CoreDNS run as processes of that
namespace, as the control plane does: the nodes share one network, so one kube-proxy serves them all.
"""

import ipaddress
import subprocess
from pathlib import Path

import yaml
from lightkube import Client
from lightkube.models.core_v1 import ServicePort, ServiceSpec
from lightkube.models.discovery_v1 import Endpoint, EndpointPort
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Service
from lightkube.resources.discovery_v1 import EndpointSlice

from tests.helpers.kube.control_plane import ControlPlane, _Process, _Started, write_kubeconfig
from tests.helpers.ports import free_port
from tests.helpers.tools import find_tool

NODE_NETWORK = ipaddress.ip_network("10.200.0.0/24")
API_ADDRESS = "10.200.0.1"
"""The API server's address (the ``kubernetes`` Service's endpoint) and CoreDNS's; nodes take the next ones."""
POD_NETWORK = ipaddress.ip_network("10.244.0.0/16")
CLUSTER_DNS = "10.0.0.10"
"""The ``kube-dns`` Service's cluster IP, in the control plane's ``SERVICE_CIDR``; the kubelets' ``clusterDNS``."""
CLUSTER_DOMAIN = "cluster.local"


def node_address(index: int) -> str:
    """Node ``index``'s address (0: ``10.200.0.2``)."""
    return str(NODE_NETWORK.network_address + 2 + index)


def pod_cidr(index: int) -> str:
    """Node ``index``'s pod subnet (0: ``10.244.1.0/24``)."""
    return str(list(POD_NETWORK.subnets(new_prefix=24))[index + 1])


def interfaces() -> list[str]:
    """The network interfaces of this process's network namespace."""
    lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    return [line.split(":", 1)[0].strip() for line in lines]


def set_up_network() -> None:
    """Loopback up, with the API server's address; nodes add theirs (``add_address``).

    Raises:
      RuntimeError: this process runs in the machine's own network namespace.
    """
    if interfaces() != ["lo"]:
        raise RuntimeError(
            "the deployment suite changes routes and iptables rules: run it in a fresh network namespace of its "
            f"own, as `make e2e-deploy` does (unshare --net); this one has {', '.join(interfaces())}"
        )
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True)
    add_address(API_ADDRESS)


def add_address(address: str) -> None:
    subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True, capture_output=True)


def cni_plugins(subnet: str, ipam_dir: Path) -> list[dict]:
    """A node's pod network: each pod a ptp link with an address of ``subnet`` (host-local, its leases in
    ``ipam_dir``: the nodes share one filesystem), every route through the node; ptp rather than a bridge, so
    that traffic between pods of one node is routed too, through kube-proxy's rules, without br_netfilter."""
    return [
        {
            "type": "ptp",
            "ipMasq": False,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": subnet}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": str(ipam_dir),
            },
        },
        {"type": "loopback"},
    ]


class ClusterServices(_Started):
    """kube-proxy (iptables mode, identity ``system:kube-proxy``) and CoreDNS (its ``kubernetes`` plugin on the
    admin kubeconfig, serving at ``API_ADDRESS``:53) for ``plane``, and the ``kube-dns`` Service that points at
    CoreDNS (no selector: an EndpointSlice of the test's own).

    Args:
      plane: a started control plane on ``API_ADDRESS``.
      node_name: the Node kube-proxy reports as (its topology hints and health only).
    """

    def __init__(self, plane: ControlPlane, node_name: str):
        super().__init__()
        self.plane = plane
        self.node_name = node_name

    def _start(self, deadline: float) -> None:
        work = self.plane.workdir / "cluster-services"
        work.mkdir()
        proxy = self._start_kube_proxy(work)
        dns = self._start_coredns(work)
        self._dns_service()
        for process in (proxy, dns):
            if process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")

    def _start_kube_proxy(self, work: Path) -> _Process:
        ca = self.plane.ca
        identity = ca.issue("kube-proxy", "system:kube-proxy")
        kubeconfig = write_kubeconfig(work / "kube-proxy.kubeconfig", self.plane.url, ca.pair, identity, "kube-proxy")
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "iptables",
            "clusterCIDR": str(POD_NETWORK),
            "hostnameOverride": self.node_name,
            "healthzBindAddress": f"127.0.0.1:{free_port()}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            # Leave the machine's conntrack settings alone (they are not per network namespace).
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        }
        config_file = work / "kube-proxy.yaml"
        config_file.write_text(yaml.safe_dump(config))
        return self._run("kube-proxy", [_binary("kube-proxy"), f"--config={config_file}"], work)

    def _start_coredns(self, work: Path) -> _Process:
        corefile = work / "Corefile"
        corefile.write_text(
            f""".:53 {{
    bind {API_ADDRESS}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {self.plane.kubeconfig} admin
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""
        )
        return self._run("coredns", [_binary("coredns"), "-conf", str(corefile)], work)

    def _dns_service(self) -> None:
        client: Client = self.plane.client()
        ports = [("dns", "UDP"), ("dns-tcp", "TCP")]
        client.create(
            Service(
                metadata=ObjectMeta(name="kube-dns", namespace="kube-system", labels={"k8s-app": "kube-dns"}),
                spec=ServiceSpec(
                    clusterIP=CLUSTER_DNS,
                    ports=[ServicePort(name=name, port=53, protocol=protocol) for name, protocol in ports],
                ),
            )
        )
        client.create(
            EndpointSlice(
                metadata=ObjectMeta(
                    name="kube-dns-coredns",
                    namespace="kube-system",
                    labels={"kubernetes.io/service-name": "kube-dns"},
                ),
                addressType="IPv4",
                endpoints=[Endpoint(addresses=[API_ADDRESS])],
                ports=[EndpointPort(name=name, port=53, protocol=protocol) for name, protocol in ports],
            )
        )

    def _run(self, name: str, argv: list[str], work: Path) -> _Process:
        process = _Process(name, argv, work / f"{name}.log")
        self.processes[name] = process
        self._stack.callback(process.stop)
        return process


def _binary(name: str) -> str:
    path = find_tool(name)
    if path is None:
        raise FileNotFoundError(f"{name} not on PATH nor in .tools/bin: run `make e2e-deploy`")
    return path
