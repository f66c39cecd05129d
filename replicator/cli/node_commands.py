"""``mtc node``, the kubelet stand-ins ``mtc publish``/``unpublish``, and ``mtc gc``: one node's commands."""

import argparse
import os
import sys

from csi_driver import kubelet
from csi_driver.identity import DEFAULT_DRIVER_NAME
from csi_driver.quantity import parse_quantity
from csi_driver.ramdisk import JobBusy
from csi_driver.volume_request import DEFAULT_MAX_NODES
from replicator.backup_tier.object_store import BackupError
from replicator.cli.arguments import (
    backup_url,
    ca_bundle,
    csi_endpoint,
    csi_socket,
    directory,
    existing_directory,
    http_url,
    job_ref,
    key_value,
    listen_address,
    non_empty,
    non_negative_float,
    positive_float,
    positive_int,
    quantity,
    readable_file,
    redundancy_setting,
    server_pair_error,
    token_file,
    usage_error,
)
from replicator.node.agent import open_ramdisks, run_node
from replicator.node.config import (
    BackupSettings,
    CoordinatorSettings,
    CsiSettings,
    NodeConfig,
    PacingSettings,
    PeerSettings,
)
from replicator.pacing import timing
from replicator.wire.tls import ServerCheck

# The agent's data directory, for ``mtc gc`` in the agent's container (``kubectl exec``) without its path.
ROOT_ENV = "MTC_ROOT"


def add(sub: argparse._SubParsersAction) -> None:
    """Adds ``node``, ``publish``, ``unpublish`` and ``gc``."""
    p = sub.add_parser("node", help="run this node's agent: the CSI plugin and the HTTP side")
    p.set_defaults(run=_run_node)
    p.add_argument("--node-id", type=non_empty, required=True, help="this node's name")
    p.add_argument(
        "--root",
        type=directory,
        required=True,
        help="data directory (created if missing); job ramdisks are mounted below it",
    )
    p.add_argument("--csi-endpoint", type=csi_endpoint, required=True, help="unix:///path/csi.sock")
    p.add_argument("--listen", type=listen_address, required=True, help="HOST:PORT of the HTTP side (health, metrics)")
    p.add_argument("--coordinator", type=http_url, help="coordinator base URL (http:// or https://)")
    p.add_argument(
        "--backup", type=backup_url, help="backup tier URL: gs://bucket/prefix, s3://bucket/prefix or file:///path"
    )
    p.add_argument(
        "--s3-endpoint-url",
        type=http_url,
        help="S3-compatible endpoint for s3:// backups (default: AWS_ENDPOINT_URL, else AWS)",
    )
    p.add_argument("--topology", type=key_value, action="append", default=[], help="topology label KEY=VALUE")
    p.add_argument(
        "--pod-address", type=non_empty, help="address pods on this node are reachable at (local runs, hostNetwork)"
    )
    p.add_argument(
        "--driver-name", type=non_empty, default=DEFAULT_DRIVER_NAME, help="CSI driver name (default %(default)s)"
    )
    p.add_argument(
        "--kubelet-registration-dir",
        type=existing_directory,
        metavar="DIR",
        help="register the driver with the kubelet through a socket in DIR, its plugins_registry "
        "(e.g. /var/lib/kubelet/plugins_registry; default: none, a node-driver-registrar sidecar does it)",
    )
    p.add_argument(
        "--ramdisk-backend",
        choices=["tmpfs", "dir"],
        default="tmpfs",
        help="tmpfs (RAM, needs root) or dir (unprivileged: data lives on disk)",
    )
    p.add_argument(
        "--default-size",
        type=quantity,
        default=parse_quantity("1Gi"),
        help="ramdisk size when a volume sets none (default 1Gi)",
    )
    p.add_argument(
        "--retention-seconds",
        type=non_negative_float,
        default=24 * 3600.0,
        help="release a job's ramdisk this long after its last pod unpublished (default one day)",
    )
    p.add_argument(
        "--peer-token-file",
        type=token_file,
        help="bearer token for the peer service (a Kubernetes Secret); enables the peer tier",
    )
    p.add_argument(
        "--node-token-file",
        type=readable_file,
        help="the agent's projected ServiceAccount token (audience of the coordinator's --node-identity), sent "
        "with every report as the proof of this node; read again when the kubelet rotates it",
    )
    p.add_argument(
        "--peer-grants",
        action="store_true",
        help="serve peers only against the coordinator's signed grants (its --peer-grants), besides the token: "
        "a holder of the cluster token alone reads and writes no copy here",
    )
    p.add_argument(
        "--replicas",
        type=positive_int,
        choices=[1, 2],
        default=1,
        help="peers holding replicas of each step when data parallelism is 1 (default 1)",
    )
    p.add_argument(
        "--redundancy",
        type=redundancy_setting,
        default="replicas",
        help="how RAM copies survive node loss unless a job's replicator.yaml says: replicas (full copies on "
        "--replicas peers), xor:N (groups of N nodes, one loss per group, N/(N-1) of the checkpoint in RAM) or "
        "rs:N:K (Reed-Solomon, K losses per group); only ranks without a data-parallel peer are encoded",
    )
    p.add_argument("--backup-keep", type=positive_int, default=3, help="complete backups kept per job (default 3)")
    p.add_argument(
        "--peer-tls-cert", type=readable_file, help="serve the HTTP side over TLS with this certificate (PEM)"
    )
    p.add_argument("--peer-tls-key", type=readable_file, help="the certificate's private key (PEM)")
    p.add_argument("--peer-tls-ca", type=ca_bundle, help="CA bundle (PEM) that peers' certificates are checked against")
    p.add_argument(
        "--peer-tls-check",
        choices=[c.value for c in ServerCheck],
        default=ServerCheck.NAME.value,
        help="name: a peer's certificate must also name its address (a certificate per agent); ca: the chain to "
        "--peer-tls-ca alone, for one certificate every agent shares (default %(default)s)",
    )
    p.add_argument(
        "--coordinator-ca",
        type=ca_bundle,
        help="CA bundle (PEM) the coordinator's certificate is checked against (default: --peer-tls-ca)",
    )
    p.add_argument(
        "--max-nodes",
        type=positive_int,
        default=DEFAULT_MAX_NODES,
        help="largest job (nodes attribute) accepted (default %(default)s)",
    )
    p.add_argument(
        "--background-cpu",
        type=positive_float,
        metavar="CPUS",
        help="CPUs the agent may use while it replicates and backs up, e.g. 0.5 (default: no cap; restores never capped)",
    )
    p.add_argument(
        "--restore-deadline-seconds",
        type=positive_float,
        default=timing.RESTORE_DEADLINE_SECONDS,
        help="a restore gives up and tells the job after this long; keep it below Orbax's 300 s wait (default %(default)s)",
    )
    p.add_argument(
        "--wedged-after-seconds",
        type=positive_float,
        default=timing.WEDGED_AFTER_SECONDS,
        help="a replicator loop stalled this long makes /healthz and CSI Probe fail (default %(default)s)",
    )
    p.add_argument(
        "--min-push-interval-seconds",
        type=non_negative_float,
        default=timing.MIN_PUSH_INTERVAL_SECONDS,
        help="at most one replica push per job and peer this often; faster saves replicate one step per round (default %(default)s)",
    )
    _add_publish(sub)
    _add_gc(sub)


def _node_config(args: argparse.Namespace) -> NodeConfig:
    """``mtc node``'s flags, checked by ``_run_node``, as the agent's settings."""
    return NodeConfig(
        node_id=args.node_id,
        root=args.root,
        csi=CsiSettings(
            endpoint=args.csi_endpoint,
            driver_name=args.driver_name,
            ramdisk_backend=args.ramdisk_backend,
            default_size_bytes=args.default_size,
            retention_seconds=args.retention_seconds,
            max_nodes=args.max_nodes,
            kubelet_registration_dir=args.kubelet_registration_dir,
        ),
        peer=PeerSettings(
            listen=args.listen,
            token_file=args.peer_token_file,
            replicas=args.replicas,
            redundancy=args.redundancy,
            tls_cert=args.peer_tls_cert,
            tls_key=args.peer_tls_key,
            tls_ca=args.peer_tls_ca,
            tls_check=ServerCheck(args.peer_tls_check),
            grants=args.peer_grants,
        ),
        backup=BackupSettings(
            url=args.backup,
            keep=args.backup_keep,
            # The google-cloud-storage convention for emulators; read once, here at the edge.
            storage_emulator_host=os.environ.get("STORAGE_EMULATOR_HOST")
            if (args.backup or "").startswith("gs://")
            else None,
            s3_endpoint_url=args.s3_endpoint_url,
        ),
        coordinator=CoordinatorSettings(
            url=args.coordinator, ca=args.coordinator_ca, node_token_file=args.node_token_file
        ),
        pacing=PacingSettings(
            background_cpu=args.background_cpu,
            restore_deadline_seconds=args.restore_deadline_seconds,
            wedged_after_seconds=args.wedged_after_seconds,
            min_push_interval_seconds=args.min_push_interval_seconds,
        ),
        topology=dict(args.topology),
        pod_address=args.pod_address,
    )


def _run_node(args: argparse.Namespace) -> int:
    if args.s3_endpoint_url and not (args.backup or "").startswith("s3://"):
        return usage_error("node", f"--s3-endpoint-url {args.s3_endpoint_url}: needs an s3:// --backup")
    error = server_pair_error(args.peer_tls_cert, args.peer_tls_key, "--peer-tls-cert", "--peer-tls-key")
    if error:
        return usage_error("node", error)
    if args.peer_tls_check == ServerCheck.CA and args.peer_tls_ca is None:
        # Else any certificate of the system's CAs, for any name, would pass as a peer.
        return usage_error("node", "--peer-tls-check ca needs --peer-tls-ca (the CA every peer's certificate is from)")
    try:
        run_node(_node_config(args))
    except BackupError as err:  # the store cannot be opened: no credentials for it
        print(f"mtc node: --backup {args.backup}: {err}", file=sys.stderr)
        return 1
    return 0


def _add_publish(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("publish", help="call NodePublishVolume as kubelet would (kubelet stand-in)")
    p.set_defaults(run=_run_publish)
    p.add_argument(
        "--csi-endpoint", type=csi_socket, required=True, help="unix:///path/csi.sock of a running node agent"
    )
    p.add_argument("--target", type=non_empty, required=True, help="target_path to mount the ramdisk at")
    p.add_argument("--pod", type=non_empty, required=True, help="pod name, e.g. myjob-slice-0-1-abcde")
    p.add_argument("--namespace", type=non_empty, default="default")
    p.add_argument("--pod-uid", type=non_empty, help="pod UID (default: a fresh random UID)")
    p.add_argument("--volume-id", type=non_empty, help="default: kubelet-style csi-<sha256(podUID+volume)>")
    p.add_argument("--attr", type=key_value, action="append", default=[], help="volumeAttributes KEY=VALUE")
    p = sub.add_parser("unpublish", help="call NodeUnpublishVolume as kubelet would (kubelet stand-in)")
    p.set_defaults(run=_run_unpublish)
    p.add_argument(
        "--csi-endpoint", type=csi_socket, required=True, help="unix:///path/csi.sock of a running node agent"
    )
    p.add_argument("--target", type=non_empty, required=True)
    p.add_argument("--volume-id", type=non_empty, default="unknown", help="the plugin finds the volume by target path")


def _run_publish(args: argparse.Namespace) -> int:
    volume_id = kubelet.publish(
        args.csi_endpoint, args.target, args.pod, args.namespace, args.pod_uid, args.volume_id, dict(args.attr)
    )
    print(f"published {volume_id} at {args.target}")
    return 0


def _run_unpublish(args: argparse.Namespace) -> int:
    kubelet.unpublish(args.csi_endpoint, args.target, args.volume_id)
    print(f"unpublished {args.target}")
    return 0


def _add_gc(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gc", help="release job ramdisks on this node (deletes their checkpoints)")
    p.set_defaults(run=_run_gc)
    p.add_argument(
        "--root",
        type=existing_directory,
        help=f"the node agent's --root, an existing directory (default ${ROOT_ENV}, which the node DaemonSet sets)",
    )
    p.add_argument("--ramdisk-backend", choices=["tmpfs", "dir"], default="tmpfs")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--job", type=job_ref, help="NAMESPACE/JOB to release")
    which.add_argument("--idle", action="store_true", help="release every ramdisk no pod has published")
    p.add_argument("--force", action="store_true", help="release even while pods have it published")


def _gc_root(flag: str | None) -> str:
    """``--root``, else ``$MTC_ROOT`` (read here, at the edge), checked as ``--root`` is.

    Raises:
      argparse.ArgumentTypeError: neither is set, or the directory does not exist; the message is one line.
    """
    if flag is not None:
        return flag
    root = os.environ.get(ROOT_ENV)
    if not root:
        raise argparse.ArgumentTypeError(f"--root is required (or ${ROOT_ENV}, set in the node DaemonSet's pods)")
    try:
        return existing_directory(root)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"${ROOT_ENV} {err}") from None


def _run_gc(args: argparse.Namespace) -> int:
    try:
        root = _gc_root(args.root)
    except argparse.ArgumentTypeError as err:
        return usage_error("gc", str(err))
    manager = open_ramdisks(root, args.ramdisk_backend)
    ref = args.job
    if ref is None:
        for namespace, job in manager.reap_idle(retention_seconds=0):
            print(f"released {namespace}/{job}")
        return 0
    try:
        released = manager.release(ref.namespace, ref.job, force=args.force)
    except JobBusy as err:
        print(f"FAILED_PRECONDITION: {err}; pass --force to release anyway", file=sys.stderr)
        return 1
    print(f"released {ref}" if released else f"no ramdisk for {ref}")
    return 0
