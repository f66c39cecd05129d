"""``mtc status`` and ``mtc restore-from``: the operator's commands, clients of the coordinator.

A rollback shows what it abandons first (the coordinator's preview), then asks for a typed ``yes`` on
a terminal unless ``--yes``; ``--dry-run`` only shows; ``--cancel`` withdraws it until its restore is planned.
Both send the operator's own credential (``kube_credentials``): a coordinator with operator identity checks it
with the API server and RBAC; one without takes ``--token-file``'s cluster token for a rollback.
"""

import argparse
import ssl
import sys

import msgspec

from replicator.cli.arguments import (
    ca_bundle,
    http_url,
    job_ref,
    non_empty,
    non_negative_int,
    readable_file,
    token_file,
)
from replicator.cli.kube_credentials import Credential, operator_credential
from replicator.coordinator.api.status import (
    Coordinator,
    Refused,
    render_preview,
    render_status,
)
from replicator.wire.messages import JobRef

_SERVER_NAME_HELP = (
    "check the coordinator's certificate against NAME, not the URL's host (through kubectl port-forward)"
)


def add(sub: argparse._SubParsersAction) -> None:
    """Adds ``status`` and ``restore-from``."""
    p = sub.add_parser("status", help="jobs, ranks, and which steps are held where")
    p.set_defaults(run=_run_status)
    p.add_argument("--coordinator", type=http_url, required=True, help="coordinator base URL")
    p.add_argument("--job", type=job_ref, help="only this job, NAMESPACE/JOB")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--ca", type=ca_bundle, help="CA bundle (PEM) for an https:// coordinator")
    p.add_argument("--tls-server-name", type=non_empty, metavar="NAME", help=_SERVER_NAME_HELP)
    _add_credential(p)
    _add_restore_from(sub)


def _add_credential(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kubeconfig",
        type=readable_file,
        help="send this kubeconfig's token (default: in a pod its service account's, else $KUBECONFIG, else "
        "~/.kube/config): your identity for a coordinator with --operator-identity",
    )
    p.add_argument("--context", type=non_empty, help="the kubeconfig's context to use (default: its current one)")
    p.add_argument(
        "--token-file",
        type=token_file,
        help="send this token instead: the cluster token for a coordinator without --operator-identity, or a "
        "Kubernetes token of yours",
    )


def _json(message) -> str:
    return msgspec.json.format(msgspec.json.encode(message), indent=2).decode()


def _coordinator(args: argparse.Namespace) -> tuple[Coordinator, Credential]:
    """The coordinator the flags name, and the credential they name (``operator_credential``) it is sent.

    Raises:
      ValueError: ``--tls-server-name`` without https://; a credential that cannot be loaded.
    """
    if args.tls_server_name and not args.coordinator.startswith("https://"):
        raise ValueError(f"--tls-server-name needs an https:// --coordinator, not {args.coordinator!r}")
    credential = operator_credential(args.token_file, args.kubeconfig, args.context)
    return Coordinator(args.coordinator, args.ca, args.tls_server_name, credential.token), credential


def _failed(args: argparse.Namespace, err: OSError, credential: Credential) -> int:
    """Prints why a request failed on one line: the coordinator's refusal (a 401 also says what was sent), or that
    it is unreachable."""
    if isinstance(err, Refused):
        print(f"{err} ({credential.source})" if err.code == 401 else err, file=sys.stderr)
        return 1
    reason = getattr(err, "reason", None)
    hint = ""
    if (
        isinstance(reason, ssl.SSLCertVerificationError)
        and "mismatch" in (reason.verify_message or "")
        and not args.tls_server_name
    ):
        hint = " (its certificate names another host: through a port-forward, give --tls-server-name with the name it covers)"
    print(f"UNAVAILABLE: coordinator {args.coordinator}: {err}{hint}", file=sys.stderr)
    return 1


def _run_status(args: argparse.Namespace) -> int:
    try:
        coordinator, credential = _coordinator(args)
    except ValueError as err:
        print(f"mtc status: {err}", file=sys.stderr)
        return 2
    try:
        status = coordinator.status(args.job)
    except OSError as err:
        return _failed(args, err, credential)
    print(_json(status) if args.json else render_status(status))
    return 0


def _add_restore_from(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("restore-from", help="make a job's next restore use a given step (roll back), from any tier")
    p.set_defaults(run=_run_restore_from)
    p.add_argument("--coordinator", type=http_url, required=True, help="coordinator base URL")
    p.add_argument("--job", type=job_ref, required=True, help="NAMESPACE/JOB")
    p.add_argument("--step", type=non_negative_int, help="the step to restore (required unless --cancel)")
    p.add_argument("--ca", type=ca_bundle, help="CA bundle (PEM) for an https:// coordinator")
    p.add_argument("--tls-server-name", type=non_empty, metavar="NAME", help=_SERVER_NAME_HELP)
    _add_credential(p)
    p.add_argument("--dry-run", action="store_true", help="only show what the rollback would abandon")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation (needed without a terminal)")
    p.add_argument(
        "--cancel", action="store_true", help="cancel the job's pending rollback (until its restore is planned)"
    )
    p.add_argument("--json", action="store_true", help="print the preview as JSON")


def _run_restore_from(args: argparse.Namespace) -> int:
    try:
        ref = args.job
        if (args.step is None) != args.cancel:
            raise ValueError("give --step S to roll back, or --cancel to cancel a pending rollback")
        if not (args.yes or args.dry_run or args.cancel) and not sys.stdin.isatty():
            raise ValueError("no terminal to confirm on: pass --yes (or --dry-run to only see what it abandons)")
        coordinator, credential = _coordinator(args)
    except ValueError as err:
        print(f"mtc restore-from: {err}", file=sys.stderr)
        return 2
    try:
        if args.cancel:
            step = coordinator.cancel_restore_from(ref)
            print(f"{ref}: the rollback to step {step} is cancelled; the next restore takes the newest step")
            return 0
        preview = coordinator.preview_restore_from(ref, args.step)
        print(_json(preview) if args.json else render_preview(preview))
        if args.dry_run or not (args.yes or _confirmed(ref, args.step)):
            return 0 if args.dry_run else 1
        coordinator.restore_from(ref, args.step)
    except OSError as err:
        return _failed(args, err, credential)
    print(
        f"{ref} will restore step {args.step} when its pods are next recreated; until that restore is planned, "
        f"mtc restore-from --job {ref} --cancel withdraws it"
    )
    return 0


def _confirmed(ref: JobRef, step: int) -> bool:
    """Asks on the terminal; only a typed ``yes`` confirms."""
    try:
        answer = input(f"Roll {ref} back to step {step}, abandoning the steps above? Type yes to confirm: ")
    except EOFError:
        answer = ""
    if answer.strip() != "yes":
        print("not rolled back", file=sys.stderr)
        return False
    return True
