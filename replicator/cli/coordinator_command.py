"""``mtc coordinator``: the cluster's coordinator process."""

import argparse

from csi_driver.identity import DEFAULT_DRIVER_NAME
from csi_driver.volume_request import DEFAULT_MAX_NODES
from replicator.cli.arguments import (
    directory,
    listen_address,
    non_empty,
    positive_float,
    positive_int,
    readable_file,
    server_pair_error,
    token_file,
    usage_error,
)
from replicator.coordinator.api.config import CoordinatorConfig
from replicator.coordinator.api.service import run_coordinator
from replicator.coordinator.kube.kube_config import KubeSettings, kube_config
from replicator.coordinator.kube.kube_shape import DEFAULT_BLOCK_LABEL, ShapeSettings
from replicator.coordinator.trust.node_identity import DEFAULT_AUDIENCE, NodeIdentitySettings


def add(sub: argparse._SubParsersAction) -> None:
    """Adds ``coordinator``."""
    p = sub.add_parser("coordinator", help="run the cluster's coordinator (ranks, restore plans)")
    p.set_defaults(run=_run_coordinator)
    p.add_argument("--listen", type=listen_address, required=True, help="HOST:PORT")
    p.add_argument(
        "--state-dir", type=directory, help="keeps a snapshot to warm a restart; node reports rebuild everything anyway"
    )
    p.add_argument(
        "--node-timeout-seconds",
        type=positive_float,
        default=15.0,
        help="a node silent this long (or three missed heartbeats, if longer) gets no orders and its copies "
        "do not count as safe (default 15)",
    )
    p.add_argument(
        "--holder-grace-seconds",
        type=positive_float,
        default=60.0,
        help="a silent node's copies are waited for as restore sources this long (default 60)",
    )
    p.add_argument(
        "--token-file",
        type=token_file,
        help="the cluster token (the node agents' --peer-token-file): required of callers",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="run without --token-file: anyone who reaches the port can steer the cluster (one-machine experiments only)",
    )
    p.add_argument("--tls-cert", type=readable_file, help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", type=readable_file, help="the certificate's private key (PEM)")
    p.add_argument(
        "--no-restore-fan-out",
        dest="restore_fan_out",
        action="store_false",
        help="after a cluster loss every node reads its own shards from the backup tier, instead of one node "
        "per group of identical data-parallel ranks reading and the others fetching from it",
    )
    p.add_argument(
        "--shared-backup-upload",
        action="store_true",
        help="the ranks of a group of identical data-parallel ranks each upload their share of a backup's files "
        "that share a path, instead of one of them uploading (Orbax's data files differ per process: no gain there)",
    )
    p.add_argument(
        "--max-nodes",
        type=positive_int,
        default=DEFAULT_MAX_NODES,
        help="largest job accepted in a report (default %(default)s)",
    )
    p.add_argument(
        "--kube",
        action="store_true",
        help="read JobSet jobs' shape, ranks, rank 0's address and nodes' failure domains from the API server "
        "(in cluster: the pod's service account; else $KUBECONFIG or ~/.kube/config)",
    )
    p.add_argument("--kubeconfig", type=readable_file, help="with --kube: this kubeconfig file")
    p.add_argument(
        "--kube-namespace",
        type=non_empty,
        help="with --kube: watch Pods and JobSets in this namespace only (default: all)",
    )
    p.add_argument(
        "--driver-name",
        type=non_empty,
        default=DEFAULT_DRIVER_NAME,
        help="with --kube: the CSI driver whose volumes make a pod part of a job",
    )
    p.add_argument(
        "--block-label",
        type=non_empty,
        default=DEFAULT_BLOCK_LABEL,
        help="with --kube: the node label naming a node's block or rack; close peers share it "
        "(else the node pool, else the zone; a node's --topology block=... overrides) (default %(default)s)",
    )
    p.add_argument(
        "--node-identity",
        action="store_true",
        help="with --kube: admit a node's report only with a projected ServiceAccount token of an agent pod on "
        "that node (the agents' --node-token-file), checked with the API server",
    )
    p.add_argument(
        "--operator-identity",
        action="store_true",
        help="with --kube: mtc restore-from and mtc status take the operator's own Kubernetes token, checked with "
        "the API server (TokenReview) and RBAC (verbs on rollbacks.mtc.dev and checkpoints.mtc.dev), not the "
        "cluster token",
    )
    p.add_argument(
        "--peer-grants",
        action="store_true",
        help="sign a short-lived grant for every replica push and restore from a peer, checked by agents with "
        "--peer-grants (with --node-identity: a restore view goes only to an agent on the rank's node)",
    )
    p.add_argument(
        "--agent-namespace",
        type=non_empty,
        help="with --node-identity: the namespace of the agents' DaemonSet and ServiceAccount (required)",
    )
    p.add_argument(
        "--agent-service-account",
        type=non_empty,
        default="mtc",
        help="with --node-identity: the agents' ServiceAccount (default %(default)s)",
    )
    p.add_argument(
        "--agent-daemonset",
        type=non_empty,
        default="mtc-node",
        help="with --node-identity: the agents' DaemonSet (default %(default)s)",
    )
    p.add_argument(
        "--node-token-audience",
        type=non_empty,
        default=DEFAULT_AUDIENCE,
        help="with --node-identity: the audience of the agents' tokens (default %(default)s)",
    )


def _node_identity(args: argparse.Namespace) -> NodeIdentitySettings | str | None:
    """The per-node identity settings of the flags, None when off, or the usage error."""
    if not args.node_identity:
        return None
    if not args.kube:
        return "--node-identity needs --kube (the API server vouches for the nodes)"
    if args.token_file is None:
        return "--node-identity needs --token-file (the cluster token is still required of every caller)"
    if args.agent_namespace is None:
        return "--node-identity needs --agent-namespace (the namespace of the agents' DaemonSet)"
    return NodeIdentitySettings(
        args.agent_namespace, args.agent_service_account, args.agent_daemonset, args.node_token_audience
    )


def _run_coordinator(args: argparse.Namespace) -> int:
    error = server_pair_error(args.tls_cert, args.tls_key, "--tls-cert", "--tls-key")
    if error:
        return usage_error("coordinator", error)
    if args.token_file is None and not args.insecure:
        return usage_error(
            "coordinator",
            "--token-file is required (the cluster token); pass --insecure to run without one on a one-machine experiment",
        )
    if (args.kubeconfig or args.kube_namespace) and not args.kube:
        return usage_error("coordinator", "--kubeconfig and --kube-namespace need --kube")
    kube = (
        KubeSettings(args.kubeconfig, args.kube_namespace, ShapeSettings(args.driver_name, args.block_label))
        if args.kube
        else None
    )
    try:
        if kube is not None:
            kube_config(kube)
    except ValueError as err:
        return usage_error("coordinator", str(err))
    node_identity = _node_identity(args)
    if isinstance(node_identity, str):
        return usage_error("coordinator", node_identity)
    if args.operator_identity and not args.kube:
        return usage_error("coordinator", "--operator-identity needs --kube (the API server vouches for operators)")
    run_coordinator(
        CoordinatorConfig(
            args.listen,
            args.state_dir,
            args.node_timeout_seconds,
            args.token_file,
            args.tls_cert,
            args.tls_key,
            args.max_nodes,
            args.holder_grace_seconds,
            kube,
            args.restore_fan_out,
            args.shared_backup_upload,
            node_identity,
            args.peer_grants,
            args.operator_identity,
        )
    )
    return 0
