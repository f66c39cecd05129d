"""``mtc status`` and ``mtc restore-from``: the operator's commands, clients of the coordinator."""

import argparse
import sys

import msgspec

from replicator.coordinator.status import (
    fetch_status,
    render_status,
    request_restore_from,
)
from replicator.wire.bearer import read_token
from replicator.wire.messages import JobRef


def add(sub: argparse._SubParsersAction) -> None:
    """Adds ``status`` and ``restore-from``."""
    p = sub.add_parser("status", help="jobs, ranks, and which steps are held where")
    p.set_defaults(run=_run_status)
    p.add_argument("--coordinator", required=True, help="coordinator base URL")
    p.add_argument("--job", help="only this job")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--ca", help="CA bundle (PEM) for an https:// coordinator")
    _add_restore_from(sub)


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
    p.set_defaults(run=_run_restore_from)
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
