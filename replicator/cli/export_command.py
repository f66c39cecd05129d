"""``mtc export``: one committed PyTorch step as a stock DCP checkpoint (or safetensors), readable without mtc.

The step comes from a directory (a node's step or a multi-node step, docs/pytorch.md "The files"), verified against
the agent's manifests (``--manifest``), or from the backup store, where each node's files are downloaded and verified
against its rank manifest's CRC32C (``BackupStore.download_rank``) into ``node-<n>-of-<N>/`` of a work directory.
``mtc_torch.export`` then writes it with torch's own writers. torch is imported only here, when the command runs:
the agent's image has none, and a missing torch is a one-line error.
"""

import argparse
import contextlib
import importlib
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from csi_driver.volume_request import DNS1123_LABEL
from replicator.backup_tier.backends import open_backup_store
from replicator.backup_tier.object_store import BackupError
from replicator.backup_tier.store import BackupStore
from replicator.cli.arguments import (
    backup_url,
    existing_directory,
    non_empty,
    non_negative_int,
    positive_int,
    readable_file,
    usage_error,
)
from replicator.local_tier.step_manifest import StepManifest, UnusableCopy, check_step
from replicator.wire.messages import JobRef

# mtc_torch.step_layout's names, which this side may not import before it knows torch is there.
_NODE = "node-{n}-of-{total}"
_NODE_RE = re.compile(r"^node-([0-9]{1,6})-of-([0-9]{1,6})$")


def add(sub: argparse._SubParsersAction) -> None:
    """Adds ``export``."""
    p = sub.add_parser("export", help="write one committed PyTorch step as a stock DCP checkpoint or safetensors")
    p.set_defaults(run=_run)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--step-dir", type=existing_directory, metavar="DIR", help="a step directory (a node's, or node-*-of-N/)"
    )
    source.add_argument("--backup", type=backup_url, metavar="URL", help="the backup store: gs://, s3:// or file://")
    p.add_argument(
        "--manifest",
        type=readable_file,
        action="append",
        default=[],
        help="with --step-dir: the agent's checksums of a node's step (<ramdisk>/mtc/manifests/<step>.json), one "
        "per node; every file is verified against them",
    )
    p.add_argument("--unverified", action="store_true", help="with --step-dir and no --manifest: export unchecked")
    p.add_argument("--namespace", type=non_empty, help="with --backup: the job's namespace")
    p.add_argument("--job", type=non_empty, help="with --backup: the job's name")
    p.add_argument("--step", type=non_negative_int, help="with --backup: the step (default: the newest backed up)")
    p.add_argument("--s3-endpoint-url", type=non_empty, help="an S3-compatible endpoint for an s3:// --backup")
    p.add_argument("--to", type=Path, required=True, metavar="DIR", help="the export's directory (must not exist)")
    p.add_argument("--format", choices=("dcp", "safetensors"), default="dcp", help="default dcp")
    p.add_argument("--threads", type=positive_int, default=4, help="files read and written at once (default 4)")


def _run(args: argparse.Namespace) -> int:
    problem = _flag_problem(args)
    if problem:
        return usage_error("export", problem)
    try:  # by name: the agent's type check (its venv has no torch) does not follow it
        export_step = importlib.import_module("mtc_torch.export").export_step
    except ImportError as err:
        # The agent's wheel holds no mtc_torch (it is the mtc-torch distribution): either import may fail.
        print(f"mtc export: needs torch and mtc-torch (pip install 'mtc-checkpointing[torch]'): {err}", file=sys.stderr)
        return 1
    try:
        with _step(args) as step_dir, _progress("export", _step_bytes(step_dir)) as advance:
            done = export_step(step_dir, args.to, fmt=args.format, threads=args.threads, progress=advance)
    except (ValueError, BackupError, UnusableCopy, OSError) as err:  # PartialRestoreError is a ValueError
        print(f"mtc export: {err}".splitlines()[0], file=sys.stderr)
        return 1
    left_out = f"; left out (not tensors): {', '.join(done.left_out)}" if done.left_out else ""
    print(f"exported {done.items} items ({done.bytes} bytes) to {args.to} as {args.format}{left_out}")
    return 0


def _flag_problem(args: argparse.Namespace) -> str | None:
    if args.backup:
        if not (args.namespace and args.job):
            return "--backup needs --namespace and --job"
        for flag, value in (("--namespace", args.namespace), ("--job", args.job)):
            if not DNS1123_LABEL.match(value):
                return f"{flag} {value}: not a DNS-1123 label (lowercase letters, digits and '-')"
        if args.manifest or args.unverified:
            return "--manifest and --unverified go with --step-dir; a backup is verified against its own manifests"
        if args.s3_endpoint_url and not args.backup.startswith("s3://"):
            return f"--s3-endpoint-url {args.s3_endpoint_url}: needs an s3:// --backup"
    elif args.namespace or args.job or args.step is not None:
        return "--namespace, --job and --step go with --backup"
    elif not (args.manifest or args.unverified):
        return "give the step's checksums with --manifest (one per node), or --unverified to export unchecked"
    if os.path.lexists(args.to):
        return f"--to {args.to}: exists; an export goes to a new directory"
    return None


@contextlib.contextmanager
def _step(args: argparse.Namespace) -> Iterator[Path]:
    """The verified step's directory: ``--step-dir`` itself, or a download into a work directory beside ``--to``
    (removed afterwards)."""
    if args.step_dir is not None:
        step_dir = Path(args.step_dir)
        _verify_dir(step_dir, [_manifest(Path(m)) for m in args.manifest])
        yield step_dir
        return
    store = open_backup_store(args.backup, s3_endpoint_url=args.s3_endpoint_url)
    work = Path(tempfile.mkdtemp(prefix=f".{args.to.name}.download-", dir=args.to.absolute().parent))
    try:
        _download(store, JobRef(args.namespace, args.job), args.step, work)
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _manifest(path: Path) -> StepManifest:
    """A ``StepManifest`` from its JSON file; ValueError naming the file when it is not one."""
    try:
        return StepManifest.from_json(path.read_text())
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--manifest {path}: not a step manifest ({err!r})") from None


def _verify_dir(step_dir: Path, manifests: list[StepManifest]) -> None:
    """Checks a node's step against its one manifest, or each ``node-<n>-of-<N>/`` against node n's.

    Raises:
      ValueError: the manifests do not match the directory's nodes (one each).
      UnusableCopy: a file is missing, unexpected, of another size or fails its CRC32C (``CorruptCopy``).
    """
    nodes = {int(m[1]): entry.name for entry in step_dir.iterdir() if (m := _NODE_RE.match(entry.name))}
    if not nodes:
        if len(manifests) > 1:
            raise ValueError(f"{step_dir} is one node's step but {len(manifests)} manifests were given")
        for manifest in manifests:
            check_step(str(step_dir), manifest, str(step_dir))
        return
    by_node = {m.rank: m for m in manifests}
    if manifests and (sorted(by_node) != sorted(nodes) or len(by_node) != len(manifests)):
        raise ValueError(
            f"{step_dir} holds nodes {sorted(nodes)} but the manifests are of nodes {[m.rank for m in manifests]}"
        )
    for rank, manifest in sorted(by_node.items()):
        check_step(str(step_dir / nodes[rank]), manifest, f"{step_dir} node {rank}")


def _download(store: BackupStore, job: JobRef, step: int | None, work: Path) -> None:
    """Downloads every node's files of ``step`` (None: the newest complete step) into ``work/node-<n>-of-<N>/``,
    each verified against its rank manifest.

    Raises:
      ValueError: no complete backup of the job, or none of ``step``.
      BackupError: the store failed, or a file fails its checksum (``CorruptBackup``).
    """
    complete = store.complete_steps(job)
    chosen = [s for s in complete if step is None or s[0] == step]
    if not chosen:
        held = ", ".join(str(s) for s, _ in complete) or "none"
        raise ValueError(
            f"{store.url}: no complete backup of {job}"
            + (f" at step {step}" if step is not None else "")
            + f" (held: {held})"
        )
    number, timeline = chosen[-1]
    nodes = store.committed_nodes(job, number, timeline)
    manifests = [store.rank_manifest(job, number, n, timeline) for n in range(nodes)]
    total = sum(m.step_manifest().total_bytes for m in manifests if m is not None)  # a missing one: download_rank says
    with _progress(f"download step {number}", total) as advance:
        for n in range(nodes):
            store.download_rank(
                job, number, n, str(work / _NODE.format(n=n, total=nodes)), timeline=timeline, on_range=advance
            )


def _step_bytes(step_dir: Path) -> int:
    """The bytes of the step's data files (what the export reads, give or take replicas)."""
    return sum(p.stat().st_size for p in step_dir.rglob("*.distcp") if p.is_file())


@contextlib.contextmanager
def _progress(what: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (tqdm when installed, else a line every 5 s); yields the callback taking bytes."""
    lock = threading.Lock()
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        yield from _lines(what, total, lock)
        return
    with tqdm(total=total, unit="B", unit_scale=True, desc=what, file=sys.stderr) as bar:

        def advance(n: int) -> None:
            with lock:
                bar.update(n)

        yield advance


def _lines(what: str, total: int, lock: threading.Lock) -> Iterator[Callable[[int], None]]:
    """Progress without tqdm: a line on stderr every 5 s, and one at the end."""
    done, shown = [0], [time.monotonic()]

    def advance(n: int) -> None:
        with lock:
            done[0] += n
            if time.monotonic() - shown[0] >= 5:
                shown[0] = time.monotonic()
                print(f"{what}: {done[0]} of {total} bytes", file=sys.stderr)

    yield advance
    print(f"{what}: {done[0]} of {total} bytes, done", file=sys.stderr)
