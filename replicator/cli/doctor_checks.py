"""``mtc doctor``'s checks: each returns ``Verdict``s that say what was found and, when it fails, the fix.

Two kinds: the cluster's, read with lightkube from a kubeconfig (a laptop) or a service account (the node agents
have none: there they are skipped); and this machine's (run in an agent's container): the data dir's mount
propagation, the node token, the memory free for ramdisks and the agent's memory limit. The coordinator's and the
backup store's need only their URL.
"""

import base64
import dataclasses
import email.utils
import enum
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

from lightkube import Client, operators
from lightkube.generic_resource import create_global_resource
from lightkube.resources.apps_v1 import DaemonSet
from lightkube.resources.core_v1 import Namespace, Node, Pod
from lightkube.utils.quantity import parse_quantity

from replicator.backup_tier.backends import open_backup_store
from replicator.backup_tier.probe import probe_store
from replicator.wire.tls import ServerCheck, client_context

CHECKPOINTING_LABEL = "mtc.dev/checkpointing"
MAX_CLOCK_SKEW_SECONDS = 30.0  # peer grants are valid +-30 s around the coordinator's clock
# Generic (read as dicts): the kubelet writes a CSINode of a node with no driver as ``"drivers": null``, which
# lightkube's typed model refuses.
CSINode = create_global_resource("storage.k8s.io", "v1", "CSINode", "csinodes")
AGENT_SELECTOR: dict[str, Any] = {"app.kubernetes.io/name": "mtc", "app.kubernetes.io/component": "node"}


class Outcome(enum.Enum):
    OK = "ok"
    FAIL = "FAIL"
    SKIP = "skip"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One check's answer.

    Attributes:
      check: what was checked, with the object (``CSINode node-1``).
      outcome: ok, FAIL, or skip (not checkable from here).
      detail: what was found, one line.
      fix: what to do, one line; empty when ok.
    """

    check: str
    outcome: Outcome
    detail: str
    fix: str = ""


def _ok(check: str, detail: str) -> Verdict:
    return Verdict(check, Outcome.OK, detail)


def csi_nodes(client: Client, driver: str) -> list[Verdict]:
    """Each Node's CSINode lists ``driver``: the agent on it registered with its kubelet."""
    registered = {
        c["metadata"]["name"]
        for c in map(_dict, client.list(CSINode))
        if any(d.get("name") == driver for d in c.get("spec", {}).get("drivers") or [])
    }
    return [
        _ok(f"driver registered on {name}", f"CSINode lists {driver}")
        if name in registered
        else Verdict(
            f"driver registered on {name}",
            Outcome.FAIL,
            f"CSINode {name} does not list {driver}",
            f"is the agent on {name} running? kubectl get pods -A -o wide -l app.kubernetes.io/component=node "
            f"--field-selector spec.nodeName={name}; its log names why it did not register",
        )
        for name in sorted(_dict(n)["metadata"]["name"] for n in client.list(Node))
    ]


def agent_daemonset(client: Client) -> list[Verdict]:
    """The agents' DaemonSet: its data dir mounted ``Bidirectional`` and no memory limit on the agent."""
    found = [_dict(d) for d in client.list(DaemonSet, namespace="*", labels=AGENT_SELECTOR)]
    if not found:
        return [Verdict("agent DaemonSet", Outcome.FAIL, "none labelled " + str(AGENT_SELECTOR), "install the chart")]
    verdicts = []
    for daemonset in found:
        where = f"{daemonset['metadata']['namespace']}/{daemonset['metadata']['name']}"
        container = daemonset["spec"]["template"]["spec"]["containers"][0]
        mounts = container.get("volumeMounts") or []
        bidirectional = [m["mountPath"] for m in mounts if m.get("mountPropagation") == "Bidirectional"]
        verdicts.append(
            _ok(f"mount propagation of {where}", f"Bidirectional: {', '.join(bidirectional)}")
            if bidirectional
            else Verdict(
                f"mount propagation of {where}",
                Outcome.FAIL,
                "no volume mounted Bidirectional: ramdisks would not reach the pods",
                "install from the chart (its DaemonSet mounts the data dir Bidirectional)",
            )
        )
        limit = (container.get("resources", {}).get("limits") or {}).get("memory")
        verdicts.append(_memory_limit(f"memory limit of {where}", limit))
    return verdicts


def _memory_limit(check: str, limit: str | None) -> Verdict:
    if limit is None:
        return _ok(check, "none (tmpfs pages the agent writes are charged to it)")
    return Verdict(
        check,
        Outcome.FAIL,
        f"{limit}: a restore or a replica it receives can OOM-kill it",
        "remove the agent's memory limit (chart: node.resources.limits.memory; docs/install.md)",
    )


def namespaces(client: Client, driver: str) -> list[Verdict]:
    """Each namespace with a pod that mounts ``driver`` is labelled for checkpointing; the agents' namespace lets
    privileged pods run (pod security ``enforce=privileged``)."""
    verdicts = []
    pods = [_dict(p) for p in client.list(Pod, namespace="*")]
    using = {p["metadata"]["namespace"] for p in pods if _mounts(p, driver)}
    agents = {_dict(p)["metadata"]["namespace"] for p in client.list(Pod, namespace="*", labels=AGENT_SELECTOR)}
    for namespace in map(_dict, client.list(Namespace)):
        name, labels = namespace["metadata"]["name"], namespace["metadata"].get("labels") or {}
        if name in using:
            verdicts.append(
                _ok(f"namespace {name}", f"{CHECKPOINTING_LABEL}=enabled")
                if labels.get(CHECKPOINTING_LABEL) == "enabled"
                else Verdict(
                    f"namespace {name}",
                    Outcome.FAIL,
                    f"its pods mount {driver}, but it lacks {CHECKPOINTING_LABEL}=enabled: their volumes are refused",
                    f"kubectl label namespace {name} {CHECKPOINTING_LABEL}=enabled",
                )
            )
        if name in agents:
            enforce = labels.get("pod-security.kubernetes.io/enforce", "")
            verdicts.append(
                _ok(f"pod security of {name}", f"enforce={enforce or '(none)'}")
                if enforce in ("", "privileged")
                else Verdict(
                    f"pod security of {name}",
                    Outcome.FAIL,
                    f"enforce={enforce}: the privileged node agent is refused",
                    f"kubectl label --overwrite namespace {name} pod-security.kubernetes.io/enforce=privileged",
                )
            )
    return verdicts


def _dict(obj: Any) -> dict[str, Any]:
    """A lightkube object as a plain dict (its fields are all optional: read with ``get``)."""
    as_dict: dict[str, Any] = obj.to_dict()
    return as_dict


def _mounts(pod: dict[str, Any], driver: str) -> bool:
    return any((v.get("csi") or {}).get("driver") == driver for v in pod.get("spec", {}).get("volumes") or [])


def node_memory(client: Client, minimum_bytes: int) -> list[Verdict]:
    """Each Node's allocatable memory less its pods' memory requests: what ramdisks can take there."""
    requested: dict[str, int] = {}
    for pod in map(
        _dict, client.list(Pod, namespace="*", fields={"status.phase": operators.not_in(["Succeeded", "Failed"])})
    ):
        if node := pod["spec"].get("nodeName"):
            for c in pod["spec"]["containers"]:
                memory = (c.get("resources", {}).get("requests") or {}).get("memory")
                requested[node] = requested.get(node, 0) + int(parse_quantity(memory) or 0)
    verdicts = []
    for node in map(_dict, client.list(Node)):
        name = node["metadata"]["name"]
        allocatable = int(parse_quantity((node.get("status", {}).get("allocatable") or {}).get("memory", "0")) or 0)
        free = allocatable - requested.get(name, 0)
        detail = f"{_gib(free)} free of {_gib(allocatable)} allocatable (pods request {_gib(requested.get(name, 0))})"
        verdicts.append(
            _ok(f"memory for ramdisks on {name}", detail)
            if free >= minimum_bytes
            else Verdict(
                f"memory for ramdisks on {name}",
                Outcome.FAIL,
                detail + f", below {_gib(minimum_bytes)}",
                "the training pods' memory requests must cover their ramdisks: lower the ramdisk size or the "
                "pods per node",
            )
        )
    return verdicts


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB"


def coordinator(url: str, ca: str | None, now: float | None = None) -> list[Verdict]:
    """``GET /healthz`` answers (over TLS checked against ``ca`` for https://), and the coordinator's clock (its
    ``Date`` header, to the second) is within ``MAX_CLOCK_SKEW_SECONDS`` of this machine's."""
    context = ssl.create_default_context(cafile=ca) if url.startswith("https://") else None
    sent = time.time()
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/healthz", timeout=10, context=context) as response:
            date = response.headers.get("Date")
    except OSError as err:
        reason = getattr(err, "reason", err)
        fix = (
            "give --ca the coordinator's CA (the chart's mtc-tls Secret, ca.crt)"
            if isinstance(reason, ssl.SSLError)
            else "is the coordinator running and its Service reachable from here? (kubectl port-forward)"
        )
        return [Verdict("coordinator", Outcome.FAIL, f"{url}: {reason}", fix)]
    local = (sent + time.time()) / 2 if now is None else now
    verdicts = [_ok("coordinator", f"{url} answers" + (" over TLS" if context else ""))]
    if date is None:
        return [*verdicts, Verdict("clock skew", Outcome.SKIP, "the coordinator sent no Date header")]
    skew = email.utils.parsedate_to_datetime(date).timestamp() - local
    detail = f"{skew:+.0f} s against the coordinator (to 1 s)"
    verdicts.append(
        _ok("clock skew", detail)
        if abs(skew) <= MAX_CLOCK_SKEW_SECONDS - 1
        else Verdict(
            "clock skew",
            Outcome.FAIL,
            detail + f": peer grants allow {MAX_CLOCK_SKEW_SECONDS:.0f} s",
            "sync this node's clock (chrony or systemd-timesyncd)",
        )
    )
    return verdicts


def _health(url: str, context: ssl.SSLContext | None) -> dict[str, Any]:
    """``GET <url>/healthz``'s JSON body, whatever its status (the agent's is 503 while wedged).

    Raises:
      OSError: it does not answer, or not with a JSON object.
    """
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/healthz", timeout=10, context=context) as response:
            body = json.load(response)
    except urllib.error.HTTPError as err:
        body = json.load(err)
    except ValueError as err:
        raise OSError(f"/healthz answered no JSON: {err}") from None
    if not isinstance(body, dict):
        raise OSError("/healthz answered no JSON object")
    return body


def grant_keys(coordinator_url: str, ca: str | None, agent_url: str, agent_ca: str | None) -> list[Verdict]:
    """The agent at ``agent_url`` holds the key the coordinator signs peer grants with now (both ``/healthz``).

    The coordinator makes its key at its start; an agent learns it from its next answered report and keeps the
    last two (``replicator.wire.grants``). Keys carry no expiry: "current" is "the coordinator's of now". An
    https:// agent's certificate is checked against ``agent_ca`` alone, as its peers check it (the chart's names
    no address).
    """
    try:
        signing = _health(coordinator_url, ssl.create_default_context(cafile=ca) if ca else None).get("grant_key")
    except OSError as err:
        return [Verdict("grant keys", Outcome.SKIP, f"the coordinator does not answer: {getattr(err, 'reason', err)}")]
    try:
        context = client_context(agent_ca, ServerCheck.CA) if agent_url.startswith("https://") else None
        body = _health(agent_url, context)
    except OSError as err:
        return [
            Verdict(
                "grant keys",
                Outcome.FAIL,
                f"the agent at {agent_url}: {getattr(err, 'reason', err)}",
                "give --agent the agent's --listen address: http://127.0.0.1:8470, or https:// with --agent-ca "
                "(its --peer-tls-ca) under peer TLS",
            )
        ]
    if "grant_keys" not in body:
        return [
            Verdict("grant keys", Outcome.SKIP, "the agent's /healthz names no keys (an agent older than this check)")
        ]
    return [grant_keys_verdict(signing, body["grant_keys"])]


def grant_keys_verdict(signing: str | None, held: list[str] | None) -> Verdict:
    """Whether an agent holding the keys ``held`` (``key_id``s, oldest first; None without ``--peer-grants``)
    accepts the grants signed with ``signing`` (None: the coordinator signs none)."""
    if held is None and signing is None:
        return Verdict("grant keys", Outcome.SKIP, "peer grants are off")
    if held is None:
        return Verdict("grant keys", Outcome.SKIP, "the agent serves peers without grants (its --peer-grants is off)")
    if signing is None:
        return Verdict(
            "grant keys",
            Outcome.FAIL,
            "the agent serves peers only against grants, but the coordinator signs none: every peer refuses "
            "this node's replicas and restores",
            "run the coordinator with --peer-grants (chart: nodeIdentity.peerGrants), as the agents",
        )
    if signing in held:
        return _ok("grant keys", f"the agent holds the coordinator's key {signing} (of {len(held)} kept)")
    return Verdict(
        "grant keys",
        Outcome.FAIL,
        f"the coordinator signs with {signing}, the agent holds {', '.join(held) or 'no key'}: it refuses the "
        "grants the coordinator issues now",
        "an agent learns the key from its next answered report, seconds after the coordinator's start; if this "
        "stays, it cannot reach this coordinator (its log: 'coordinator unreachable') or reports to another one",
    )


def backup_store(url: str, emulator_host: str | None, s3_endpoint_url: str | None) -> list[Verdict]:
    """The agent's start probe (``backup_tier.probe``): upload, create, read, list, delete."""
    try:
        store = open_backup_store(url, emulator_host=emulator_host, s3_endpoint_url=s3_endpoint_url)
    except Exception as err:  # a backend's credential lookup raises its own kinds: shown, not raised
        return [Verdict("backup store", Outcome.FAIL, f"{url}: {err}", "check the URL and the credentials")]
    result = probe_store(store.objects, os.uname().nodename)
    if result.usable:
        return [_ok("backup store", f"{url}: write, read, list and delete in {result.seconds:.2f} s")]
    return [
        Verdict(
            "backup store",
            Outcome.FAIL,
            f"{url}: {result.error}",
            "does the bucket exist, and may the agents' credentials write and delete in it?",
        )
    ]


def data_dir(root: str, mountinfo: str = "/proc/self/mountinfo") -> list[Verdict]:
    """On this machine: the mount holding ``root`` is shared (``shared:`` in mountinfo), so ramdisks mounted below it
    reach the host and the pods."""
    best = ("", "")
    with open(mountinfo, encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            point, optional = fields[4], fields[6 : fields.index("-")]
            if (root == point or root.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
                best = (point, " ".join(optional))
    if "shared:" in best[1]:
        return [_ok(f"mount propagation of {root}", f"on {best[0]}, shared")]
    return [
        Verdict(
            f"mount propagation of {root}",
            Outcome.FAIL,
            f"on {best[0] or '?'}, not shared",
            "mount the data dir Bidirectional, on a shared host mount (docs/install.md: the ramdisks' directory)",
        )
    ]


def node_token(path: str, now: float | None = None) -> list[Verdict]:
    """The agent's projected token (``--node-token-file``) has not expired (the kubelet rotates it)."""
    try:
        with open(path, encoding="utf-8") as f:
            payload = f.read().strip().split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        expires = float(claims["exp"])
    except (OSError, IndexError, ValueError, KeyError, TypeError) as err:
        return [Verdict("node token", Outcome.FAIL, f"{path}: {err}", "is the projected token mounted?")]
    left = expires - (time.time() if now is None else now)
    if left > 0:
        return [_ok("node token", f"{path}: expires in {left:.0f} s")]
    return [
        Verdict(
            "node token",
            Outcome.FAIL,
            f"{path}: expired {-left:.0f} s ago",
            "the kubelet no longer rotates it: restart the agent's pod",
        )
    ]


def local_memory(minimum_bytes: int, cgroup_limit: str = "/sys/fs/cgroup/memory.max") -> list[Verdict]:
    """On this machine: memory available for ramdisks, and this container's memory limit (cgroup v2)."""
    import psutil  # only for the checks run in an agent's container

    available = psutil.virtual_memory().available
    verdicts = [
        _ok("memory for ramdisks here", f"{_gib(available)} available")
        if available >= minimum_bytes
        else Verdict(
            "memory for ramdisks here",
            Outcome.FAIL,
            f"{_gib(available)} available, below {_gib(minimum_bytes)}",
            "lower the ramdisk size, or free memory on this node",
        )
    ]
    try:
        with open(cgroup_limit, encoding="utf-8") as f:
            limit = f.read().strip()
    except OSError:
        return [*verdicts, Verdict("memory limit here", Outcome.SKIP, f"no {cgroup_limit} (not cgroup v2)")]
    verdicts.append(_memory_limit("memory limit here", None if limit == "max" else f"{int(limit) >> 20}Mi"))
    return verdicts


def failed(verdicts: Iterable[Verdict]) -> bool:
    return any(v.outcome is Outcome.FAIL for v in verdicts)
