"""``mtc status`` and ``mtc restore-from``: the operator's commands, clients of the coordinator."""

import argparse
import sys

import msgspec

from replicator.cli.arguments import ca_bundle, http_url, job_ref, non_negative_int, token_file
from replicator.coordinator.status import (
    fetch_status,
    render_status,
    request_restore_from,
)
from replicator.wire.bearer import read_token


def add(sub: argparse._SubParsersAction) -> None:
    """Adds ``status`` and ``restore-from``."""
    p = sub.add_parser("status", help="jobs, ranks, and which steps are held where")
    p.set_defaults(run=_run_status)
    p.add_argument("--coordinator", type=http_url, required=True, help="coordinator base URL")
    p.add_argument("--job", type=job_ref, help="only this job (NAMESPACE/JOB)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--ca", type=ca_bundle, help="CA bundle (PEM) for an https:// coordinator")
    _add_restore_from(sub)


def _run_status(args: argparse.Namespace) -> int:
    try:
        status = fetch_status(args.coordinator, args.job and args.job.job, args.ca)
    except OSError as err:
        print(f"UNAVAILABLE: coordinator {args.coordinator}: {err}", file=sys.stderr)
        return 1
    if args.job:  # the coordinator filters by the job's name
        status = msgspec.structs.replace(status, jobs=tuple(j for j in status.jobs if j.namespace == args.job.namespace))
    print(msgspec.json.format(msgspec.json.encode(status), indent=2).decode() if args.json else render_status(status))
    return 0


def _add_restore_from(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("restore-from", help="make a job's next restore use a given step (roll back), from any tier")
    p.set_defaults(run=_run_restore_from)
    p.add_argument("--coordinator", type=http_url, required=True, help="coordinator base URL")
    p.add_argument("--job", type=job_ref, required=True, help="NAMESPACE/JOB")
    p.add_argument("--step", type=non_negative_int, required=True)
    p.add_argument("--token-file", type=token_file, help="the cluster token, when the coordinator requires one")
    p.add_argument("--ca", type=ca_bundle, help="CA bundle (PEM) for an https:// coordinator")


def _run_restore_from(args: argparse.Namespace) -> int:
    try:
        token = read_token(args.token_file) if args.token_file else None
        error = request_restore_from(args.coordinator, args.job, args.step, token, args.ca)
    except OSError as err:
        print(f"UNAVAILABLE: coordinator {args.coordinator}: {err}", file=sys.stderr)
        return 1
    if error:
        print(error, file=sys.stderr)
        return 1
    print(f"{args.job} will restore step {args.step} when its pods are next recreated")
    return 0
