"""A real Kubernetes control plane on 127.0.0.1, as processes this harness starts and stops by PID: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler and the JobSet controller (its CRD installed, its
webhooks pointed at it over loopback). ``make k8s-tools`` builds the binaries; etcd is Debian's.

No kubelet runs here: Pods are created, scheduled and bound, and stay Pending.
"""

import base64
import contextlib
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml
from lightkube import ApiError, Client, KubeConfig
from lightkube.codecs import load_all_yaml
from lightkube.models.core_v1 import NodeCondition, NodeSpec, NodeStatus
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.core_v1 import Node, ServiceAccount

from examples.local_cluster import scratch_dir
from tests.helpers.kube.pki import CertificateAuthority, KeyPair, service_account_keys
from tests.helpers.ports import free_port
from tests.helpers.tools import find_tool

JOBSET_VERSION = "v0.10.1"
"""The JobSet release the Makefile's ``k8s-tools`` builds; its CRD and webhook manifests sit beside the tools'
``bin`` in ``jobset-<version>/``."""

SERVICE_CIDR = "10.0.0.0/24"
"""The Service IP range: only allocated on loopback (no kube-proxy runs), routed by kube-proxy in ``make
e2e-deploy``'s cluster network (``pod_network.py``)."""

_STOP_SECONDS = 10.0


@dataclass(frozen=True)
class Binaries:
    """The executables and manifests of the control plane."""

    etcd: str
    apiserver: str
    controller_manager: str
    scheduler: str
    jobset: str
    jobset_crd: Path
    jobset_webhooks: Path

    @classmethod
    def find(cls) -> "Binaries":
        """The binaries on PATH or in ``.tools/bin``.

        Raises:
          FileNotFoundError: one is missing; the message names it and the make target.
        """
        names = {
            "etcd": "etcd",
            "apiserver": "kube-apiserver",
            "controller_manager": "kube-controller-manager",
            "scheduler": "kube-scheduler",
            "jobset": "jobset",
        }
        found = {field: find_tool(name) for field, name in names.items()}
        missing = [names[field] for field, path in found.items() if path is None]
        if missing:
            raise FileNotFoundError(f"{', '.join(missing)} not on PATH nor in .tools/bin: run `make k8s-tools`")
        config = Path(found["jobset"]).resolve().parent.parent / f"jobset-{JOBSET_VERSION}"
        crd, webhooks = config / "jobset.x-k8s.io_jobsets.yaml", config / "manifests.yaml"
        for path in (crd, webhooks):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: run `make k8s-tools`")
        return cls(**found, jobset_crd=crd, jobset_webhooks=webhooks)


class _Process:
    """One component: its command, its log file, its PID; stopped by that PID (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, command: list[str], log: Path):
        self.name = name
        self.log = log
        self.command = command
        with log.open("wb") as out:
            self.popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def restart(self) -> None:
        """Stops it (if running) and starts its command again, appending to its log."""
        self.stop()
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def write_kubeconfig(path: Path, server: str, ca: KeyPair, user: KeyPair, name: str) -> Path:
    """A kubeconfig for ``server`` with the CA and the client certificate embedded, as every component reads."""
    data = lambda pem: base64.b64encode(pem).decode()  # noqa: E731
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority-data": data(ca.cert_pem())}}
        ],
        "users": [
            {
                "name": name,
                "user": {"client-certificate-data": data(user.cert_pem()), "client-key-data": data(user.key_pem())},
            }
        ],
        "contexts": [{"name": name, "context": {"cluster": "local", "user": name, "namespace": "default"}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


class _Started:
    """Processes started in order and stopped in reverse by ``stop`` (idempotent; it also stops what a
    failed ``start`` left half way). Use as a context manager, or ``start()`` then ``stop()``; a subclass
    implements ``_start(deadline)`` and registers every cleanup on ``self._stack``."""

    def __init__(self):
        self.processes: dict[str, _Process] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_seconds: float = 120.0):
        """Starts everything and returns self once it is ready.

        Raises:
          RuntimeError: a process exited or was not ready in time; the message has its log's tail.
        """
        try:
            self._start(time.monotonic() + timeout_seconds)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stops every process by its PID, newest first, and undoes what ``start`` did."""
        self._stack.close()
        self.processes.clear()

    def _start(self, deadline: float) -> None:
        raise NotImplementedError


class ControlPlane(_Started):
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the JobSet controller on free
    127.0.0.1 ports, in a scratch directory that ``stop`` removes.

    Use as a context manager, or ``start()`` then ``stop()``; ``stop`` is idempotent and stops what was started
    even when ``start`` failed half way.

    Attributes (after ``start``):
      url: the API server's ``https://127.0.0.1:PORT``.
      kubeconfig: an admin kubeconfig (a client certificate in ``system:masters``).
      workdir: the scratch directory (certificates, kubeconfigs, logs, etcd's data).
      processes: each component by name, for its PID and log.
    """

    def __init__(self, binaries: Binaries | None = None, address: str = "127.0.0.1", audited: tuple[str, ...] = ()):
        super().__init__()
        # Groups whose requests the API server logs (verb, resource, response code) to ``audit_log``, JSON lines.
        self.audited = audited
        self.binaries = binaries or Binaries.find()
        # The API server's address: loopback, where the `kubernetes` Service gets no endpoints (Endpoints may not
        # hold a loopback address) and a pod that needs the API server is given its URL; else an address of a
        # network of the test's own (pod_network.py), the `kubernetes` Service's endpoint, as on a real cluster.
        self.address = address
        self._readiness: dict[str, tuple[str, ssl.SSLContext | None]] = {}
        self.workdir: Path | None = None

    def client(self) -> Client:
        """A synchronous lightkube client with the admin identity."""
        return Client(KubeConfig.from_file(self.kubeconfig), field_manager="mtc-tests")

    def stop_component(self, name: str) -> None:
        """Stops one component by its PID (SIGTERM, then SIGKILL), as an outage would: ``kube-apiserver``, ...
        ``start_component`` brings it back; ``stop`` stops it for good either way."""
        self.processes[name].stop()

    def start_component(self, name: str, timeout_seconds: float = 60.0) -> None:
        """Starts a component ``stop_component`` stopped, with the same command, and returns once it is ready.

        Raises:
          RuntimeError: it exited or was not ready in time; the message has its log's tail.
        """
        process = self.processes[name]
        process.restart()
        url, tls = self._readiness[name]
        self._wait_ready(process, url, tls, time.monotonic() + timeout_seconds)

    def _start(self, deadline: float) -> None:
        workdir, cleanup = self._stack.enter_context(scratch_dir("mtc-k8s-"))
        self.workdir = work = Path(workdir)
        pki = work / "pki"
        pki.mkdir()
        self.ca = ca = CertificateAuthority(pki)
        sa = service_account_keys(pki)
        loopback = {"dns_names": ("localhost",), "ips": ("127.0.0.1",)}
        apiserver_names = (
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        )
        serving = ca.issue(
            "apiserver",
            "kube-apiserver",
            dns_names=apiserver_names,
            ips=tuple(dict.fromkeys(("127.0.0.1", self.address, "10.0.0.1"))),
        )
        admin = ca.issue("admin", "mtc-admin", organizations=("system:masters",))
        kubelet_client = ca.issue(
            "apiserver-kubelet-client", "kube-apiserver-kubelet-client", organizations=("system:masters",)
        )
        # The front proxy's identity (aggregated APIs), as kubeadm sets it: without it the controller-manager and
        # the scheduler log, every few seconds, that the request-header CA is missing.
        front_proxy = ca.issue("front-proxy-client", "front-proxy-client")

        ports = {
            name: free_port() for name in ("etcd", "etcd-peer", "kcm", "scheduler", "jobset-webhook", "jobset-health")
        }
        ports["apiserver"] = free_port(self.address)
        self.url = f"https://{self.address}:{ports['apiserver']}"
        self.kubeconfig = write_kubeconfig(work / "admin.kubeconfig", self.url, ca.pair, admin, "admin")

        def start(name: str, command: list[str]) -> _Process:
            process = _Process(name, command, work / f"{name}.log")
            self.processes[name] = process
            cleanup.callback(process.stop)
            return process

        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
        etcd = start(
            "etcd",
            [
                self.binaries.etcd,
                "--name=default",
                f"--data-dir={work / 'etcd'}",
                "--logger=zap",
                "--log-outputs=stderr",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
            ],
        )
        self._wait_ready(etcd, f"{etcd_url}/health", None, deadline)

        apiserver = start(
            "kube-apiserver",
            [
                self.binaries.apiserver,
                f"--etcd-servers={etcd_url}",
                f"--bind-address={self.address}",
                f"--advertise-address={self.address}",
                f"--secure-port={ports['apiserver']}",
                f"--cert-dir={work / 'apiserver-certs'}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={ca.pair.cert}",
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                f"--kubelet-certificate-authority={ca.pair.cert}",
                # A kubelet here serves on its own loopback address, which is its node's name (tests/helpers/kube/node.py).
                "--kubelet-preferred-address-types=Hostname,InternalIP,ExternalIP",
                f"--service-account-key-file={sa.cert}",
                f"--service-account-signing-key-file={sa.key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--requestheader-client-ca-file={ca.pair.cert}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={front_proxy.cert}",
                f"--proxy-client-key-file={front_proxy.key}",
                f"--endpoint-reconciler-type={'none' if self.address.startswith('127.') else 'lease'}",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--profiling=false",
                *self._audit_flags(work),
            ],
        )
        admin_tls = ssl.create_default_context(cafile=str(ca.pair.cert))
        admin_tls.load_cert_chain(str(admin.cert), str(admin.key))
        self._wait_ready(apiserver, f"{self.url}/readyz", admin_tls, deadline)

        client = self.client()
        for crd in load_all_yaml(self.binaries.jobset_crd.read_text()):
            client.create(crd)
            self._wait(
                lambda: _established(client, crd.metadata.name), deadline, f"CRD {crd.metadata.name} established"
            )

        def start_controller(name: str, short: str, binary: str, port: int, *extra: str) -> _Process:
            """A controller of the control plane: its own identity ``system:<name>``, a kubeconfig for it, and a
            loopback serving certificate."""
            kubeconfig = write_kubeconfig(
                work / f"{short}.kubeconfig", self.url, ca.pair, ca.issue(name, f"system:{name}"), short
            )
            serving = ca.issue(f"{short}-serving", name, **loopback)
            return start(
                name,
                [
                    binary,
                    f"--kubeconfig={kubeconfig}",
                    f"--authentication-kubeconfig={kubeconfig}",
                    f"--authorization-kubeconfig={kubeconfig}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={port}",
                    f"--tls-cert-file={serving.cert}",
                    f"--tls-private-key-file={serving.key}",
                    "--leader-elect=false",
                    *extra,
                ],
            )

        kcm = start_controller(
            "kube-controller-manager",
            "kcm",
            self.binaries.controller_manager,
            ports["kcm"],
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={sa.key}",
            f"--root-ca-file={ca.pair.cert}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Nodes without a kubelet (``register_node``) renew no lease: an hour's grace keeps them
            # Ready (and untainted) for the session, so recreated pods schedule there again.
            "--node-monitor-grace-period=1h",
        )
        scheduler = start_controller("kube-scheduler", "scheduler", self.binaries.scheduler, ports["scheduler"])

        jobset = self._start_jobset(start, work, ca, ports)

        ca_tls = ssl.create_default_context(cafile=str(ca.pair.cert))
        self._wait_ready(kcm, f"https://127.0.0.1:{ports['kcm']}/healthz", ca_tls, deadline)
        self._wait_ready(scheduler, f"https://127.0.0.1:{ports['scheduler']}/healthz", ca_tls, deadline)
        self._wait_ready(jobset, f"http://127.0.0.1:{ports['jobset-health']}/readyz", None, deadline)
        self._register_jobset_webhooks(client, ca.pair, ports["jobset-webhook"])
        self._wait(
            lambda: _exists(client, ServiceAccount, "default", "default"), deadline, "ServiceAccount default/default"
        )

    def _audit_flags(self, work: Path) -> list[str]:
        if not self.audited:
            return []
        self.audit_log = work / "audit.log"
        policy = {
            "apiVersion": "audit.k8s.io/v1",
            "kind": "Policy",
            "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata", "userGroups": list(self.audited)}, {"level": "None"}],
        }
        (work / "audit-policy.yaml").write_text(yaml.safe_dump(policy))
        return [
            f"--audit-policy-file={work / 'audit-policy.yaml'}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
        ]

    def _start_jobset(self, start, work: Path, ca: CertificateAuthority, ports: dict[str, int]) -> _Process:
        """The JobSet controller with the admin identity, its own certificate management off, serving its
        webhooks on loopback with a certificate from our CA."""
        certs = work / "jobset-certs"
        certs.mkdir()
        pair = ca.issue("jobset-webhook", "jobset-webhook", dns_names=("localhost",), ips=("127.0.0.1",))
        (certs / "tls.crt").write_bytes(pair.cert_pem())
        (certs / "tls.key").write_bytes(pair.key_pem())
        config = {
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "internalCertManagement": {"enable": False},
            "leaderElection": {"leaderElect": False},
            "webhook": {"port": ports["jobset-webhook"], "host": "127.0.0.1", "certDir": str(certs)},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['jobset-health']}"},
            "metrics": {"bindAddress": "0"},
        }
        config_file = work / "jobset-config.yaml"
        config_file.write_text(yaml.safe_dump(config))
        return start(
            "jobset",
            [
                self.binaries.jobset,
                f"--config={config_file}",
                f"--kubeconfig={self.kubeconfig}",
                "--metrics-bind-address=0",
                f"--health-probe-bind-address=127.0.0.1:{ports['jobset-health']}",
            ],
        )

    def _register_jobset_webhooks(self, client: Client, ca: KeyPair, port: int) -> None:
        """JobSet's own webhook manifests, each ``clientConfig`` turned from an in-cluster Service into
        ``https://127.0.0.1:PORT/<path>`` with our CA as the bundle."""
        bundle = base64.b64encode(ca.cert_pem()).decode()
        for configuration in load_all_yaml(self.binaries.jobset_webhooks.read_text()):
            for webhook in configuration.webhooks:
                path = webhook.clientConfig.service.path
                webhook.clientConfig.service = None
                webhook.clientConfig.url = f"https://127.0.0.1:{port}{path}"
                webhook.clientConfig.caBundle = bundle
            configuration.metadata.name = f"jobset-{configuration.metadata.name}"
            client.create(configuration)

    def _wait_ready(self, process: _Process, url: str, tls: ssl.SSLContext | None, deadline: float) -> None:
        self._readiness[process.name] = (url, tls)

        def answers() -> bool:
            if process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2, context=tls) as response:
                    return response.status == 200
            except (OSError, urllib.error.URLError):
                return False

        self._wait(answers, deadline, f"{process.name} ready at {url}", process)

    def _wait(self, condition, deadline: float, what: str, process: _Process | None = None) -> None:
        while not condition():
            if time.monotonic() > deadline:
                tail = f":\n{process.tail()}" if process else ""
                raise RuntimeError(f"{what}: not reached in time{tail}")
            time.sleep(0.2)


def _established(client: Client, name: str) -> bool:
    crd = client.get(CustomResourceDefinition, name)
    return any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or []) if crd.status)


def _exists(client: Client, kind, name: str, namespace: str | None = None) -> bool:
    try:
        client.get(kind, name, namespace=namespace)
        return True
    except ApiError as error:
        if error.status.code == 404:
            return False
        raise


def register_node(
    client: Client,
    name: str,
    *,
    labels: dict[str, str] | None = None,
    cpu: str = "64",
    memory: str = "512Gi",
    pods: str = "110",
) -> Node:
    """A Node object with no kubelet behind it, Ready, with room for ``pods`` pods, so the scheduler binds to it.

    Without a kubelet nothing renews its lease; the control plane's node-monitor grace period (an hour) keeps it
    Ready meanwhile, so recreated Pods schedule there again.
    """
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})}
    client.create(Node(metadata=ObjectMeta(name=name, labels=labels), spec=NodeSpec()))
    capacity = {"cpu": cpu, "memory": memory, "pods": pods}
    status = NodeStatus(
        capacity=capacity,
        allocatable=capacity,
        conditions=[NodeCondition(type="Ready", status="True", reason="FakeNode", message="no kubelet")],
    )
    return client.patch(Node.Status, name, {"status": status.to_dict()})
