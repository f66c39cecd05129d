"""``mtc``: the one console script. Each subcommand parses its flags into typed values here."""

import argparse
import logging
import os
import sys

import grpc
import msgspec

from csi_driver import kubelet
from csi_driver.identity import DEFAULT_DRIVER_NAME
from csi_driver.quantity import parse_quantity
from csi_driver.ramdisk import JobBusy
from csi_driver.volume_request import DEFAULT_MAX_NODES
from replicator.coordinator.kube_shape import DEFAULT_BLOCK_LABEL, ShapeSettings
from replicator.coordinator.service import (
    CoordinatorConfig,
    KubeSettings,
    kube_config,
    run_coordinator,
)
from replicator.coordinator.status import (
    fetch_status,
    render_status,
    request_restore_from,
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
from replicator.wire import tls
from replicator.wire.bearer import read_token
from replicator.wire.messages import JobRef


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _quantity(text: str) -> int:
    try:
        return parse_quantity(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _add_node(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="run this node's agent: the CSI plugin and the HTTP side")
    p.add_argument("--node-id", required=True, help="this node's name")
    p.add_argument("--root", required=True, help="data directory; job ramdisks are mounted below it")
    p.add_argument("--csi-endpoint", required=True, help="unix:///path/csi.sock")
    p.add_argument("--listen", required=True, help="HOST:PORT of the HTTP side (health, metrics)")
    p.add_argument("--coordinator", help="coordinator base URL")
    p.add_argument("--backup", help="backup tier URL: gs://bucket/prefix, s3://bucket/prefix or file:///path")
    p.add_argument("--s3-endpoint-url", help="S3-compatible endpoint for s3:// backups (default: AWS_ENDPOINT_URL, else AWS)")
    p.add_argument("--topology", type=_key_value, action="append", default=[], help="topology label KEY=VALUE")
    p.add_argument("--pod-address", help="address pods on this node are reachable at (local runs, hostNetwork)")
    p.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME, help="CSI driver name (default %(default)s)")
    p.add_argument("--kubelet-registration-dir", metavar="DIR",
                   help="register the driver with the kubelet through a socket in DIR, its plugins_registry "
                        "(e.g. /var/lib/kubelet/plugins_registry; default: none, a node-driver-registrar sidecar does it)")
    p.add_argument("--ramdisk-backend", choices=["tmpfs", "dir"], default="tmpfs",
                   help="tmpfs (RAM, needs root) or dir (unprivileged: data lives on disk)")
    p.add_argument("--default-size", type=_quantity, default=parse_quantity("1Gi"),
                   help="ramdisk size when a volume sets none (default 1Gi)")
    p.add_argument("--retention-seconds", type=float, default=24 * 3600.0,
                   help="release a job's ramdisk this long after its last pod unpublished (default one day)")
    p.add_argument("--peer-token-file", help="bearer token for the peer service (a Kubernetes Secret); enables the peer tier")
    p.add_argument("--replicas", type=int, choices=[1, 2], default=1,
                   help="peers holding replicas of each step when data parallelism is 1 (default 1)")
    p.add_argument("--backup-keep", type=int, default=3, help="complete backups kept per job (default 3)")
    p.add_argument("--peer-tls-cert", help="serve the HTTP side over TLS with this certificate (PEM)")
    p.add_argument("--peer-tls-key", help="the certificate's private key (PEM)")
    p.add_argument("--peer-tls-ca", help="CA bundle (PEM) that peers' certificates are checked against")
    p.add_argument("--coordinator-ca", help="CA bundle (PEM) the coordinator's certificate is checked against (default: --peer-tls-ca)")
    p.add_argument("--max-nodes", type=int, default=DEFAULT_MAX_NODES, help="largest job (nodes attribute) accepted (default %(default)s)")
    p.add_argument("--background-cpu", type=_positive_float, metavar="CPUS",
                   help="CPUs the agent may use while it replicates and backs up, e.g. 0.5 (default: no cap; restores never capped)")
    p.add_argument("--restore-deadline-seconds", type=_positive_float, default=timing.RESTORE_DEADLINE_SECONDS,
                   help="a restore gives up and tells the job after this long; keep it below Orbax's 300 s wait (default %(default)s)")
    p.add_argument("--wedged-after-seconds", type=_positive_float, default=timing.WEDGED_AFTER_SECONDS,
                   help="a replicator loop stalled this long makes /healthz and CSI Probe fail (default %(default)s)")
    p.add_argument("--min-push-interval-seconds", type=float, default=timing.MIN_PUSH_INTERVAL_SECONDS,
                   help="at most one replica push per job and peer this often; faster saves replicate one step per round (default %(default)s)")


def _node_config(args: argparse.Namespace) -> NodeConfig:
    """``mtc node``'s flags as the agent's settings.

    Raises:
      ValueError: flags that do not go together.
    """
    return NodeConfig(
        node_id=args.node_id,
        root=args.root,
        csi=CsiSettings(endpoint=args.csi_endpoint, driver_name=args.driver_name, ramdisk_backend=args.ramdisk_backend,
                        default_size_bytes=args.default_size, retention_seconds=args.retention_seconds, max_nodes=args.max_nodes,
                        kubelet_registration_dir=args.kubelet_registration_dir),
        peer=PeerSettings(listen=args.listen, token_file=args.peer_token_file, replicas=args.replicas,
                          tls_cert=args.peer_tls_cert, tls_key=args.peer_tls_key, tls_ca=args.peer_tls_ca),
        backup=BackupSettings(
            url=args.backup,
            keep=args.backup_keep,
            # The google-cloud-storage convention for emulators; read once, here at the edge.
            storage_emulator_host=os.environ.get("STORAGE_EMULATOR_HOST") if (args.backup or "").startswith("gs://") else None,
            s3_endpoint_url=args.s3_endpoint_url,
        ),
        coordinator=CoordinatorSettings(url=args.coordinator, ca=args.coordinator_ca),
        pacing=PacingSettings(background_cpu=args.background_cpu, restore_deadline_seconds=args.restore_deadline_seconds,
                              wedged_after_seconds=args.wedged_after_seconds, min_push_interval_seconds=args.min_push_interval_seconds),
        topology=dict(args.topology),
        pod_address=args.pod_address,
    )


def _run_node(args: argparse.Namespace) -> int:
    try:
        config = _node_config(args)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    run_node(config)
    return 0


def _add_publish(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("publish", help="call NodePublishVolume as kubelet would (kubelet stand-in)")
    p.add_argument("--csi-endpoint", required=True)
    p.add_argument("--target", required=True, help="target_path to mount the ramdisk at")
    p.add_argument("--pod", required=True, help="pod name, e.g. myjob-slice-0-1-abcde")
    p.add_argument("--namespace", default="default")
    p.add_argument("--pod-uid", help="pod UID (default: a fresh random UID)")
    p.add_argument("--volume-id", help="default: kubelet-style csi-<sha256(podUID+volume)>")
    p.add_argument("--attr", type=_key_value, action="append", default=[], help="volumeAttributes KEY=VALUE")
    p = sub.add_parser("unpublish", help="call NodeUnpublishVolume as kubelet would (kubelet stand-in)")
    p.add_argument("--csi-endpoint", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--volume-id", default="unknown", help="the plugin finds the volume by target path")


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
    p.add_argument("--root", required=True, help="the node agent's --root")
    p.add_argument("--ramdisk-backend", choices=["tmpfs", "dir"], default="tmpfs")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--job", help="NAMESPACE/JOB to release")
    which.add_argument("--idle", action="store_true", help="release every ramdisk no pod has published")
    p.add_argument("--force", action="store_true", help="release even while pods have it published")


def _run_gc(args: argparse.Namespace) -> int:
    try:  # flags first: a bad one touches nothing
        ref = None if args.idle else JobRef.parse(args.job)
    except ValueError as err:
        print(f"--job {err}", file=sys.stderr)
        return 2
    manager = open_ramdisks(args.root, args.ramdisk_backend)
    if ref is None:
        for namespace, job in manager.reap_idle(retention_seconds=0):
            print(f"released {namespace}/{job}")
        return 0
    try:
        released = manager.release(ref.namespace, ref.job, force=args.force)
    except JobBusy as err:
        print(f"FAILED_PRECONDITION: {err}; pass --force to release anyway", file=sys.stderr)
        return 1
    print(f"released {args.job}" if released else f"no ramdisk for {args.job}")
    return 0


def _add_coordinator(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="run the cluster's coordinator (ranks, restore plans)")
    p.add_argument("--listen", required=True, help="HOST:PORT")
    p.add_argument("--state-dir", help="keeps a snapshot to warm a restart; node reports rebuild everything anyway")
    p.add_argument("--node-timeout-seconds", type=float, default=15.0,
                   help="a node silent this long (or three missed heartbeats, if longer) gets no orders and its copies "
                        "do not count as safe (default 15)")
    p.add_argument("--holder-grace-seconds", type=float, default=60.0,
                   help="a silent node's copies are waited for as restore sources this long (default 60)")
    p.add_argument("--token-file", help="the cluster token (the node agents' --peer-token-file): required of callers")
    p.add_argument("--insecure", action="store_true",
                   help="run without --token-file: anyone who reaches the port can steer the cluster (one-machine experiments only)")
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    p.add_argument("--max-nodes", type=int, default=DEFAULT_MAX_NODES, help="largest job accepted in a report (default %(default)s)")
    p.add_argument("--kube", action="store_true",
                   help="read JobSet jobs' shape, ranks, rank 0's address and nodes' failure domains from the API server "
                        "(in cluster: the pod's service account; else $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--kubeconfig", help="with --kube: this kubeconfig file")
    p.add_argument("--kube-namespace", help="with --kube: watch Pods and JobSets in this namespace only (default: all)")
    p.add_argument("--driver-name", default=DEFAULT_DRIVER_NAME, help="with --kube: the CSI driver whose volumes make a pod part of a job")
    p.add_argument("--block-label", default=DEFAULT_BLOCK_LABEL,
                   help="with --kube: the node label naming a node's block or rack; close peers share it "
                        "(else the node pool, else the zone; a node's --topology block=... overrides) (default %(default)s)")


def _run_coordinator(args: argparse.Namespace) -> int:
    try:
        tls.check_pair(args.tls_cert, args.tls_key, "--tls-cert and --tls-key")
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    if args.token_file is None and not args.insecure:
        print("--token-file is required (the cluster token); pass --insecure to run without one on a one-machine experiment", file=sys.stderr)
        return 2
    if (args.kubeconfig or args.kube_namespace) and not args.kube:
        print("--kubeconfig and --kube-namespace need --kube", file=sys.stderr)
        return 2
    kube = KubeSettings(args.kubeconfig, args.kube_namespace, ShapeSettings(args.driver_name, args.block_label)) if args.kube else None
    try:
        if kube is not None:
            kube_config(kube)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    run_coordinator(CoordinatorConfig(args.listen, args.state_dir, args.node_timeout_seconds, args.token_file,
                                      args.tls_cert, args.tls_key, args.max_nodes, args.holder_grace_seconds, kube))  # fmt: skip
    return 0


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="jobs, ranks, and which steps are held where")
    p.add_argument("--coordinator", required=True, help="coordinator base URL")
    p.add_argument("--job", help="only this job")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--ca", help="CA bundle (PEM) for an https:// coordinator")


def _run_status(args: argparse.Namespace) -> int:
    try:
        status = fetch_status(args.coordinator, args.job, args.ca)
    except OSError as err:
        print(f"UNAVAILABLE: coordinator {args.coordinator}: {err}", file=sys.stderr)
        return 1
    print(msgspec.json.format(msgspec.json.encode(status), indent=2).decode() if args.json else render_status(status))
    return 0


def _add_restore_from(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("restore-from", help="make a job's next restore use a given step (roll back), from any tier")
    p.add_argument("--coordinator", required=True, help="coordinator base URL")
    p.add_argument("--job", required=True, help="NAMESPACE/JOB")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--token-file", help="the cluster token, when the coordinator requires one")
    p.add_argument("--ca", help="CA bundle (PEM) for an https:// coordinator")


def _run_restore_from(args: argparse.Namespace) -> int:
    try:
        ref = JobRef.parse(args.job)
    except ValueError as err:
        print(f"--job {err}", file=sys.stderr)
        return 2
    try:
        token = read_token(args.token_file) if args.token_file else None
        error = request_restore_from(args.coordinator, ref, args.step, token, args.ca)
    except OSError as err:
        print(f"UNAVAILABLE: coordinator {args.coordinator}: {err}", file=sys.stderr)
        return 1
    if error:
        print(error, file=sys.stderr)
        return 1
    print(f"{args.job} will restore step {args.step} when its pods are next recreated")
    return 0


_COMMANDS = {
    "node": _run_node,
    "publish": _run_publish,
    "unpublish": _run_unpublish,
    "gc": _run_gc,
    "coordinator": _run_coordinator,
    "status": _run_status,
    "restore-from": _run_restore_from,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtc", description="Multi-tier checkpointing for ML training on Kubernetes.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_node, _add_publish, _add_gc, _add_coordinator, _add_status, _add_restore_from):
        add(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _COMMANDS[args.command](args)
    except grpc.RpcError as err:
        print(f"{err.code().name}: {err.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
