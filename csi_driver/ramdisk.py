"""The node's ramdisks: one tmpfs per (namespace, job), outliving the pods that mount it.

The manager owns the on-disk truth and knows nothing about gRPC. Layout under ``root``::

    state.json                       who is published where (rebuilt from the mount table too)
    jobs/<namespace>/<job>/          the job's tmpfs, exactly the requested size
    jobs/<namespace>/<job>/client/   bind-mounted at each pod's target_path (Orbax's local dir)

Every change holds a thread lock and an ``flock`` on ``root/.lock``, so the agent's gRPC threads
and a concurrent ``mtc gc`` see one consistent state. Reads (``ramdisks``) take neither: the state
file is only ever replaced whole, and its parsed content is cached until it is replaced.
"""

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator

import psutil

from csi_driver import atomic_file, file_cache, mounts
from csi_driver.quantity import format_bytes, parse_quantity
from csi_driver.volume_request import VolumeSpec

log = logging.getLogger(__name__)

CLIENT_DIR = "client"
_STATE_FILE = "state.json"
_LOCK_FILE = ".lock"


class RamdiskError(Exception):
    """Base class; each subclass maps to one CSI status code in ``csi_driver.node``."""


class InsufficientMemory(RamdiskError):
    """The node cannot back the requested size (RESOURCE_EXHAUSTED)."""


class ShrinkBelowUsage(RamdiskError):
    """A smaller size was asked than the bytes the job already holds (FAILED_PRECONDITION)."""


class TargetInUse(RamdiskError):
    """The target path already carries a different volume (ALREADY_EXISTS)."""


class JobBusy(RamdiskError):
    """A release was asked for a job that still has published pods."""


@dataclasses.dataclass
class Publication:
    """One pod's bind mount of a job's client directory; ``published_at`` is unix seconds."""

    volume_id: str
    readonly: bool
    spec: VolumeSpec
    published_at: float


@dataclasses.dataclass
class Ramdisk:
    """One job's ramdisk on this node.

    Attributes:
      namespace, job: the key.
      size_bytes: the tmpfs size limit, bytes.
      path: the tmpfs mount point on the node.
      publications: target_path -> Publication for each pod that has it mounted.
      idle_since: unix seconds of the last unpublish that left no pod, or None while in use.
    """

    namespace: str
    job: str
    size_bytes: int
    path: str
    publications: dict[str, Publication] = dataclasses.field(default_factory=dict)
    idle_since: float | None = None

    @property
    def client_dir(self) -> str:
        """The directory pods see as their local checkpoint directory."""
        return os.path.join(self.path, CLIENT_DIR)


@dataclasses.dataclass(frozen=True)
class Usage:
    """Capacity figures of one ramdisk, bytes and inodes."""

    total_bytes: int
    used_bytes: int
    available_bytes: int
    total_inodes: int
    used_inodes: int
    available_inodes: int


def _statvfs_usage(path: str) -> Usage:
    st = os.statvfs(path)
    return Usage(
        total_bytes=st.f_blocks * st.f_frsize,
        used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize,
        available_bytes=st.f_bavail * st.f_frsize,
        total_inodes=st.f_files,
        used_inodes=st.f_files - st.f_ffree,
        available_inodes=st.f_favail,
    )


class TmpfsBackend:
    """Real ramdisks: tmpfs mounts with kernel-enforced size, bind-mounted into pods. Needs root."""

    name = "tmpfs"

    def is_present(self, path: str) -> bool:
        entry = mounts.find_mount(path)
        return entry is not None and entry.fstype == "tmpfs"

    def create(self, path: str, size_bytes: int) -> None:
        os.makedirs(path, exist_ok=True)
        mounts.mount_tmpfs(path, size_bytes)

    def resize(self, path: str, size_bytes: int) -> None:
        mounts.resize_tmpfs(path, size_bytes)

    def destroy(self, path: str) -> None:
        mounts.unmount(path)
        os.rmdir(path)

    def attach(self, source: str, target: str, readonly: bool) -> None:
        os.makedirs(target, exist_ok=True)
        mounts.bind_mount(source, target, readonly)

    def detach(self, target: str) -> None:
        if mounts.find_mount(target) is not None:
            mounts.unmount(target)

    def memory_available(self) -> int:
        return psutil.virtual_memory().available

    def usage(self, path: str) -> Usage:
        return _statvfs_usage(path)

    def adoptable(self, jobs_root: str) -> Iterator[tuple[str, int]]:
        """Yields (mount point, size bytes) of our tmpfs mounts under ``jobs_root``."""
        prefix = os.path.realpath(jobs_root) + os.sep
        for entry in mounts.mount_table():
            if entry.fstype == "tmpfs" and entry.mount_point.startswith(prefix) and entry.root == "/":
                yield entry.mount_point, parse_quantity(entry.options.get("size", "0").replace("k", "Ki"))


class DirBackend:
    """Plain directories for machines where mounting is not allowed: the data lives on DISK.

    Sizes are checked at publish time only; nothing stops a job from writing past them. Pods see
    the client directory through a symlink at target_path.
    """

    name = "dir"

    def is_present(self, path: str) -> bool:
        return os.path.isdir(path)

    def create(self, path: str, size_bytes: int) -> None:
        os.makedirs(path, exist_ok=True)

    def resize(self, path: str, size_bytes: int) -> None:
        """Nothing to do: a directory has no size limit."""

    def destroy(self, path: str) -> None:
        shutil.rmtree(path)

    def attach(self, source: str, target: str, readonly: bool) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(target)  # kubelet-style callers may pre-create an empty target
        os.symlink(source, target)

    def detach(self, target: str) -> None:
        if os.path.islink(target):
            os.unlink(target)

    def memory_available(self) -> int:
        return psutil.virtual_memory().available

    def usage(self, path: str) -> Usage:
        fs = _statvfs_usage(path)
        used = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        return dataclasses.replace(fs, used_bytes=used)

    def adoptable(self, jobs_root: str) -> Iterator[tuple[str, int]]:
        return iter(())


def make_backend(name: str) -> TmpfsBackend | DirBackend:
    """Returns the backend for ``--ramdisk-backend`` (``tmpfs`` or ``dir``)."""
    if name == "dir":
        log.warning("ramdisk backend 'dir': checkpoint data lives on DISK, not in RAM; sizes are not enforced")
        return DirBackend()
    if name == "tmpfs":
        return TmpfsBackend()
    raise ValueError(f"unknown ramdisk backend {name!r}: use tmpfs or dir")


def _parse_state(data: bytes) -> dict[tuple[str, str], Ramdisk]:
    ramdisks = {}
    for item in json.loads(data)["ramdisks"]:
        publications = {
            target: Publication(p["volume_id"], p["readonly"], VolumeSpec(**p["spec"]), p["published_at"])
            for target, p in item.pop("publications").items()
        }
        disk = Ramdisk(publications=publications, **item)
        ramdisks[(disk.namespace, disk.job)] = disk
    return ramdisks


class RamdiskManager:
    """Creates, publishes, resizes and releases the node's job ramdisks.

    Args:
      root: the agent's data directory (``--root``); tmpfs mounts live below it.
      backend: ``TmpfsBackend`` in production, ``DirBackend`` for unprivileged local runs.
      on_new_pod: the publish hook, called with the job's ramdisk and the pod's ``VolumeSpec``
        when a pod that did not hold this target publishes, before its publication is recorded and
        under the manager's lock. The node agent passes the cleanup of the framework the pod asks
        for (``Framework.clear_previous_pod``), so that a new incarnation never reads the previous
        pod's rank; the driver itself knows no framework. An exception from it fails the publish.
    """

    def __init__(
        self, root: str, backend: TmpfsBackend | DirBackend, *, on_new_pod: Callable[[Ramdisk, VolumeSpec], None]
    ):
        self.root = os.path.abspath(root)
        self.backend = backend
        self._on_new_pod = on_new_pod
        self._jobs_root = os.path.join(self.root, "jobs")
        self._thread_lock = threading.RLock()
        self._snapshots = file_cache.FileCache(_parse_state, max_entries=1)
        os.makedirs(self._jobs_root, exist_ok=True)

    # -- locking and persistence -------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[tuple[str, str], Ramdisk]]:
        with self._thread_lock, open(os.path.join(self.root, _LOCK_FILE), "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            ramdisks = self._load()
            yield ramdisks
            self._save(ramdisks)  # an exception skips this: a failed operation leaves the state file as it was

    def _load(self) -> dict[tuple[str, str], Ramdisk]:
        """The state to change: parsed afresh, never the cached snapshot others hold."""
        try:
            with open(os.path.join(self.root, _STATE_FILE), "rb") as f:
                return _parse_state(f.read())
        except FileNotFoundError:
            return {}

    def _save(self, ramdisks: dict[tuple[str, str], Ramdisk]) -> None:
        state = {"ramdisks": [dataclasses.asdict(d) for d in ramdisks.values()]}
        atomic_file.write_file_atomic(os.path.join(self.root, _STATE_FILE), json.dumps(state, indent=1).encode())

    # -- lifecycle ---------------------------------------------------------------------------

    def recover(self) -> list[Ramdisk]:
        """Reconciles the state file with the mount table after an agent (re)start.

        Ramdisks whose tmpfs is gone (a node reboot) are dropped with a warning; tmpfs mounts the
        state file missed (a crash between mount and save) are adopted as idle.

        Returns:
          The ramdisks that survived, in state order.
        """
        with self._locked() as ramdisks:
            for key, disk in list(ramdisks.items()):
                if not self.backend.is_present(disk.path):
                    log.warning("ramdisk %s/%s is gone from the mount table; its data is lost", *key)
                    del ramdisks[key]
                    continue
                for target in [t for t in disk.publications if not self._attached(disk, t)]:
                    log.warning("publication %s of %s/%s is no longer mounted; forgetting it", target, *key)
                    del disk.publications[target]
                if not disk.publications and disk.idle_since is None:
                    disk.idle_since = time.time()
            known = {d.path for d in ramdisks.values()}
            for path, size in self.backend.adoptable(self._jobs_root):
                namespace, job = os.path.relpath(path, self._jobs_root).split(os.sep)
                if path not in known:
                    log.warning("adopting ramdisk %s/%s found in the mount table", namespace, job)
                    ramdisks[(namespace, job)] = Ramdisk(namespace, job, size, path, idle_since=time.time())
            return list(ramdisks.values())

    def publish(self, volume_id: str, target_path: str, spec: VolumeSpec, readonly: bool = False) -> Ramdisk:
        """Mounts the job's ramdisk at ``target_path``, creating or resizing it first.

        Idempotent: publishing the same target again succeeds. A new pod's publish calls the
        ``on_new_pod`` hook first (the node agent's removes a stale ``jax-init-info.txt`` and the
        rest of the previous pod's protocol files).

        Raises:
          InsufficientMemory: ``spec.size_bytes`` exceeds available memory plus the job's usage.
          ShrinkBelowUsage: ``spec.size_bytes`` is below the bytes the job already holds.
          TargetInUse: ``target_path`` is a mount point of something else.
        """
        key = (spec.namespace, spec.job)
        with self._locked() as ramdisks:
            disk = ramdisks.get(key)
            if disk is not None and not self.backend.is_present(disk.path):
                # Never bind the directory under a vanished tmpfs (after a reboot it is plain disk).
                log.warning("ramdisk %s/%s is recorded but not mounted: creating it afresh", *key)
                del ramdisks[key]
                disk = None
            attached = disk is not None and self._attached(disk, target_path)
            if not attached:
                self._check_target_free(target_path)
            if disk is None:
                self._check_capacity(spec.size_bytes, held=0)
                path = os.path.join(self._jobs_root, *key)
                self.backend.create(path, spec.size_bytes)
                os.makedirs(os.path.join(path, CLIENT_DIR), exist_ok=True)
                disk = ramdisks[key] = Ramdisk(spec.namespace, spec.job, spec.size_bytes, path)
                log.info("created %s ramdisk %s/%s of %s", self.backend.name, *key, format_bytes(spec.size_bytes))
            elif spec.size_bytes != disk.size_bytes:
                self._resize(disk, spec.size_bytes)
            if not attached:
                self.backend.attach(disk.client_dir, target_path, readonly)
            previous = disk.publications.get(target_path)
            same_pod = previous is not None and previous.spec.pod_uid == spec.pod_uid
            if not same_pod:  # a new pod must never read the previous one's rank
                self._on_new_pod(disk, spec)
            disk.publications[target_path] = Publication(
                volume_id, readonly, spec, previous.published_at if previous is not None and same_pod else time.time()
            )
            disk.idle_since = None
            return disk

    def unpublish(self, target_path: str) -> Ramdisk | None:
        """Unmounts and removes ``target_path``; the job's ramdisk and its data stay.

        Idempotent: an unknown target returns None after removing an empty leftover directory.
        """
        with self._locked() as ramdisks:
            disk = next((d for d in ramdisks.values() if target_path in d.publications), None)
            if disk is not None:
                self.backend.detach(target_path)
                del disk.publications[target_path]
                if not disk.publications:
                    disk.idle_since = time.time()
            with contextlib.suppress(FileNotFoundError, OSError):
                os.rmdir(target_path)
            return disk

    def release(self, namespace: str, job: str, force: bool = False) -> bool:
        """Deletes a job's ramdisk and its data (``mtc gc``).

        Returns:
          True if a ramdisk was released, False if there was none.

        Raises:
          JobBusy: pods still have it published and ``force`` is False.
        """
        with self._locked() as ramdisks:
            disk = ramdisks.get((namespace, job))
            if disk is None:
                return False
            if disk.publications and not force:
                raise JobBusy(f"ramdisk {namespace}/{job} is published at {sorted(disk.publications)}")
            for target in disk.publications:
                self.backend.detach(target)
            self.backend.destroy(disk.path)
            del ramdisks[(namespace, job)]
            log.info("released ramdisk %s/%s", namespace, job)
            return True

    def reap_idle(self, retention_seconds: float, now: float | None = None) -> list[tuple[str, str]]:
        """Releases ramdisks idle (no pod) for longer than ``retention_seconds``; returns their keys."""
        now = time.time() if now is None else now
        expired = [
            k for k, d in self.ramdisks().items() if d.idle_since is not None and now - d.idle_since > retention_seconds
        ]
        return [key for key in expired if self._release_if_idle(*key)]

    def _release_if_idle(self, namespace: str, job: str) -> bool:
        try:
            return self.release(namespace, job)
        except JobBusy:  # a pod published between the scan and the release
            return False

    # -- queries -----------------------------------------------------------------------------

    def ramdisks(self) -> dict[tuple[str, str], Ramdisk]:
        """A snapshot of every ramdisk, keyed by (namespace, job): the last state saved. The
        ``Ramdisk`` objects are shared with other callers until the state changes: read them, never
        change them (changes go through the methods above)."""
        return dict(self._snapshots.read(os.path.join(self.root, _STATE_FILE)) or {})

    def find_by_target(self, target_path: str) -> tuple[Ramdisk, Publication] | None:
        """The ramdisk and publication mounted at ``target_path``, or None."""
        for disk in self.ramdisks().values():
            if target_path in disk.publications:
                return disk, disk.publications[target_path]
        return None

    def usage(self, disk: Ramdisk) -> Usage:
        """Bytes and inodes of ``disk``."""
        return self.backend.usage(disk.path)

    def is_healthy(self, disk: Ramdisk) -> bool:
        """True while ``disk`` is still mounted (tmpfs) or present (dir)."""
        return self.backend.is_present(disk.path)

    # -- helpers -----------------------------------------------------------------------------

    def _check_capacity(self, size_bytes: int, held: int) -> None:
        available = self.backend.memory_available()
        if size_bytes > available + held:
            raise InsufficientMemory(
                f"requested ramdisk size {size_bytes} bytes ({format_bytes(size_bytes)}) exceeds what this node "
                f"can back: {available + held} bytes ({format_bytes(available + held)}) = memory available "
                f"{available} + held by the job {held}"
            )

    def _resize(self, disk: Ramdisk, size_bytes: int) -> None:
        used = self.usage(disk).used_bytes
        if size_bytes < used:
            raise ShrinkBelowUsage(
                f"ramdisk {disk.namespace}/{disk.job} holds {used} bytes; cannot shrink it to {size_bytes} bytes"
            )
        if size_bytes > disk.size_bytes:
            self._check_capacity(size_bytes, held=used)
        self.backend.resize(disk.path, size_bytes)
        log.info("resized ramdisk %s/%s from %d to %d bytes", disk.namespace, disk.job, disk.size_bytes, size_bytes)
        disk.size_bytes = size_bytes

    def _attached(self, disk: Ramdisk, target_path: str) -> bool:
        try:
            return os.path.samestat(os.stat(target_path), os.stat(disk.client_dir))
        except FileNotFoundError:
            return False

    def _check_target_free(self, target_path: str) -> None:
        if mounts.find_mount(target_path) is not None or os.path.islink(target_path):
            raise TargetInUse(f"target_path {target_path} already carries another volume")
