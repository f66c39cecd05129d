"""``mtc doctor``: one screen of checks of an install, each naming its fix; exit 0 when none fails, else 1.

From a laptop with a kubeconfig it checks the cluster (``doctor_checks``: CSINode registration, the agents'
DaemonSet, namespaces, memory per node) and, given their URLs, the coordinator and the backup store. In an agent's
container (no API credentials: the cluster's checks are skipped) ``--root`` and ``--node-token-file`` add this
node's own: the data dir's mount propagation, its memory, the agent's limit and its token; ``--agent`` with
``--coordinator``, whether the agent holds the key the coordinator signs peer grants with now.
"""

import argparse
import os
import sys
from collections.abc import Callable

import yaml
from lightkube import ApiError, Client, KubeConfig
from lightkube.core.exceptions import ConfigError

from replicator.cli import doctor_checks as checks
from replicator.cli.arguments import backup_url as backup_url_type
from replicator.cli.arguments import ca_bundle, http_url, non_empty, quantity, readable_file
from replicator.cli.doctor_checks import Outcome, Verdict

DEFAULT_DRIVER_NAME = "ramdisk.csi.mtc.dev"


def add(sub: argparse._SubParsersAction) -> None:
    """Adds ``doctor``."""
    p = sub.add_parser("doctor", help="check an install: each check names its fix; exit 1 when one fails")
    p.set_defaults(run=_run)
    p.add_argument("--kubeconfig", type=readable_file, help="the cluster's (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--context", type=non_empty, help="the kubeconfig's context (default: its current one)")
    p.add_argument("--driver-name", type=non_empty, default=DEFAULT_DRIVER_NAME, help="CSI driver name")
    p.add_argument("--coordinator", type=http_url, help="coordinator base URL: check it answers, its TLS, the clock")
    p.add_argument("--ca", type=ca_bundle, help="CA bundle (PEM) for an https:// coordinator")
    p.add_argument("--backup", type=backup_url_type, help="the backup store to probe: gs://, s3:// or file://")
    p.add_argument("--s3-endpoint-url", type=http_url, help="an S3-compatible endpoint for an s3:// --backup")
    p.add_argument("--root", type=non_empty, help="in an agent's container: its data dir, checked on this node")
    p.add_argument("--node-token-file", type=non_empty, help="in an agent's container: its projected token")
    p.add_argument(
        "--agent",
        type=http_url,
        help="in an agent's container: its address (http://127.0.0.1:8470): with --coordinator, check that it holds "
        "the coordinator's current grant key",
    )
    p.add_argument("--agent-ca", type=ca_bundle, help="CA bundle (PEM) for an https:// --agent: its --peer-tls-ca")
    p.add_argument(
        "--min-free", type=quantity, default=1 << 30, help="memory a node must have for ramdisks (default 1Gi)"
    )


def _cluster_client(args: argparse.Namespace) -> Client | str:
    """A client of the API server, or why there is none."""
    try:
        config = KubeConfig.from_file(args.kubeconfig) if args.kubeconfig else KubeConfig.from_env()
        return Client(config.get(args.context) if args.context else config, field_manager="mtc-doctor")
    except (ConfigError, OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as err:
        return f"no API server configuration ({err}): the node agents hold none; run from a kubeconfig's machine"


def _cluster(args: argparse.Namespace) -> list[Verdict]:
    client = _cluster_client(args)
    if isinstance(client, str):
        return [Verdict("cluster", Outcome.SKIP, client)]
    runs: list[tuple[str, Callable[[], list[Verdict]]]] = [
        ("driver registration", lambda: checks.csi_nodes(client, args.driver_name)),
        ("agent DaemonSet", lambda: checks.agent_daemonset(client)),
        ("namespaces", lambda: checks.namespaces(client, args.driver_name)),
        ("node memory", lambda: checks.node_memory(client, args.min_free)),
    ]
    verdicts = []
    for what, run in runs:
        try:
            verdicts += run()
        except (ApiError, OSError) as err:  # one unreadable kind (RBAC, network) leaves the others to check
            reason = err.status.message if isinstance(err, ApiError) else str(err)
            fix = "your kubeconfig's user needs get/list on it" if isinstance(err, ApiError) else ""
            verdicts.append(Verdict(what, Outcome.FAIL, f"cannot read the API server: {reason}", fix))
    return verdicts


def run_checks(args: argparse.Namespace) -> list[Verdict]:
    """Every check the flags ask for, in screen order."""
    verdicts = _cluster(args)
    if args.coordinator:
        verdicts += checks.coordinator(args.coordinator, args.ca)
    if args.backup:
        verdicts += checks.backup_store(args.backup, os.environ.get("STORAGE_EMULATOR_HOST"), args.s3_endpoint_url)
    if args.root:
        verdicts += checks.data_dir(os.path.realpath(args.root)) + checks.local_memory(args.min_free)
    if args.node_token_file:
        verdicts += checks.node_token(args.node_token_file)
    if args.agent:
        verdicts += checks.grant_keys(args.coordinator, args.ca, args.agent, args.agent_ca)
    return verdicts


def render(verdicts: list[Verdict]) -> str:
    """One line per check (``ok``, ``FAIL``, ``skip``), a failed one's fix under it, and a last line counting."""
    width = max((len(v.check) for v in verdicts), default=0)
    lines = []
    for v in verdicts:
        lines.append(f"{v.outcome.value:<4}  {v.check:<{width}}  {v.detail}")
        if v.outcome is Outcome.FAIL and v.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {v.fix}")
    failed = sum(v.outcome is Outcome.FAIL for v in verdicts)
    lines.append(f"{failed} of {len(verdicts)} checks failed" if failed else f"all {len(verdicts)} checks passed")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    if args.s3_endpoint_url and not (args.backup or "").startswith("s3://"):
        print(f"mtc doctor: --s3-endpoint-url {args.s3_endpoint_url}: needs an s3:// --backup", file=sys.stderr)
        return 2
    if args.agent and not args.coordinator:
        print(f"mtc doctor: --agent {args.agent}: needs --coordinator (whose grant key it checks)", file=sys.stderr)
        return 2
    if (args.agent or "").startswith("https://") and not args.agent_ca:
        print(f"mtc doctor: --agent {args.agent}: an https:// agent needs --agent-ca", file=sys.stderr)
        return 2
    verdicts = run_checks(args)
    print(render(verdicts))
    return 1 if checks.failed(verdicts) else 0
