"""Elastic restores on a node: stages the old nodes' copies of a step that a job saved on another node
count, for its reader to load resharded (``mtc_torch.StepReader``).

The coordinator's view (``RestoreView.saved_nodes`` set) lists, for each old node whose copy this rank
needs, that copy's sources, fastest first. Each copy is staged from the first source that serves it
verified, as a same-shape restore stages its one copy, into ``node-<n>-of-<N>/`` (old node ``n`` of
``N``: a verbatim copy of its committed step directory) under one new directory. Once every copy is
there, the directory is renamed to ``Framework.resharded_name(step)`` (``.mtc-resharded-<step>``),
and the marker points at it. A copy held on this node (its own old step, or a replica) is hard-linked:
no byte is copied. Nothing staged here becomes this node's step: the node's own old copy stays as it
was, a copy of its old rank, and the staged directory is removed once the job commits a newer step
(``drop_resharded``) or the next restore begins (``clear_for_restore``).
"""

import contextlib
import logging
import os
import shutil
import stat
from collections.abc import Awaitable, Callable, Iterable

from prefetch.restore_states import Staged
from replicator.local_tier import pod_files
from replicator.local_tier.frameworks import Framework
from replicator.local_tier.frameworks.client_dir import RESHARDED_PREFIX
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.step_manifest import StepManifest, UnusableCopy, check_step
from replicator.wire.messages import RestoreView, Source

log = logging.getLogger(__name__)

# (sources of one old node's copy, the directory to stage it into) -> what staging it came to.
StageOne = Callable[[tuple[Source, ...], str], Awaitable[Staged]]


def part_name(data_rank: int, saved_nodes: int) -> str:
    """``node-<n>-of-<N>``: old node ``n``'s copy in an elastic restore's staged step."""
    return f"node-{data_rank}-of-{saved_nodes}"


def by_old_node(sources: Iterable[Source]) -> dict[int, tuple[Source, ...]]:
    """The view's sources per old node (their ``data_rank``), each node's in the view's order."""
    parts: dict[int, list[Source]] = {}
    for source in sources:
        parts.setdefault(source.data_rank, []).append(source)
    return {rank: tuple(found) for rank, found in sorted(parts.items())}


async def stage_parts(
    framework: Framework, local_dir: str, meta: JobMeta, view: RestoreView, stage_one: StageOne
) -> Staged:
    """Stages every old node's copy the view lists, then installs them as the step's resharded
    directory. Returns the outcome of the first copy no source served (nothing installed), else one
    whose ``summary`` names each copy's source (``node-<n>-of-<N>=<tier>:<holder>``)."""
    assert view.step is not None and view.saved_nodes is not None  # an elastic view stages a step
    building = meta.new_incoming_dir()
    bad, unreachable, used, first = [], [], [], None
    try:
        for data_rank, sources in by_old_node(view.sources).items():
            name = part_name(data_rank, view.saved_nodes)
            staged = await stage_one(sources, os.path.join(building, name))
            bad += staged.bad
            unreachable += staged.unreachable
            if staged.source is None:
                return Staged(None, bad, unreachable)
            first = first or staged.source
            used.append(f"{name}={staged.source.tier}:{staged.source.holder}")
        if first is None:
            return Staged(None, bad, unreachable)
        install(framework, local_dir, view.step, building)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return Staged(first, bad, unreachable, ",".join(used))


def link_copy(step_dir: str, manifest: StepManifest, part_dir: str, what: str) -> None:
    """Hard-links the files of a copy held on this ramdisk into ``part_dir``, then verifies them
    there: what is verified is what the job reads, whatever the pod does to its own directory after.

    Raises:
      CorruptCopy, UnusableCopy: as ``check_step``; a file that cannot be linked is an UnusableCopy. Nothing is
        left in ``part_dir`` then: the next source fills it.
    """
    try:
        for path in manifest.files:
            target = os.path.join(part_dir, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # a missing file is named by the check below
                os.link(os.path.join(step_dir, path), target, follow_symlinks=False)
        check_step(part_dir, manifest, what)
    except OSError as err:
        shutil.rmtree(part_dir, ignore_errors=True)
        raise UnusableCopy(f"{what} cannot be linked: {err}") from err
    except UnusableCopy:
        shutil.rmtree(part_dir, ignore_errors=True)
        raise


def install(framework: Framework, local_dir: str, step: int, building: str) -> None:
    """Renames the directory of staged copies to ``resharded_name(step)``, in place of an earlier one."""
    name = framework.resharded_name(step)
    with pod_files.open_dir(local_dir) as fd:
        pod_files.remove(fd, name)
        os.rename(building, name, dst_dir_fd=fd)
        pod_files.fsync_dir(fd)


def linked(local_dir: str, name: str) -> bool:
    """Whether a symlink in ``local_dir`` points at ``name`` (a marker, or the job's link after it took one)."""
    with pod_files.open_dir(local_dir) as fd:
        return any(stat.S_ISLNK(status.st_mode) and _points_at(fd, link, name) for link, status in pod_files.names(fd))


def drop_resharded(local_dir: str, keep: Callable[[int], bool]) -> None:
    """Removes every elastic restore's staged directory whose step ``keep`` refuses, with the job's
    ``step=<n>`` link to it: after a newer commit (the job loaded it before it trained on), or when
    another restore begins."""
    with pod_files.open_dir(local_dir) as fd:
        entries = dict(pod_files.names(fd))
        for name in entries:
            if not name.startswith(RESHARDED_PREFIX):
                continue
            step = pod_files.parse_int_name(name[len(RESHARDED_PREFIX) :])
            if step is not None and keep(step):
                continue
            for link, status in entries.items():
                if stat.S_ISLNK(status.st_mode) and _points_at(fd, link, name):
                    pod_files.remove(fd, link)
            pod_files.remove(fd, name)
            log.info("removed %s of %s", name, local_dir)


def _points_at(fd: int, link: str, target: str) -> bool:
    try:
        return os.readlink(link, dir_fd=fd) == target
    except OSError:
        return False
