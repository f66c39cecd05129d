"""What the node agent remembers about one job ramdisk, stored on the ramdisk itself.

It lives beside the pod-visible client dir (``<ramdisk>/mtc/``), so it survives an agent restart
exactly as long as the data it describes::

    mtc/manifests/<step>.json                 StepManifest of each committed step in client/
    mtc/assignment.json                       the current pod's incarnation, rank and progress
    mtc/lineage.json                          {"forks": [...]}: the job's rollbacks (``messages.in_lineage``)
    mtc/framework                             the name of the job's framework (``frameworks.REGISTRY``)
    mtc/replicas/rank-<r>/<step>/             another rank's step, pushed here by a peer
    mtc/replicas/rank-<r>/<step>.json         its manifest, written after the data is in place
    mtc/incoming/<id>/                        a replica or restore still being received: never read

Only the agent writes here, always by replacing a file whole (``pod_files.write_file_atomic``).
Manifests and progress are read from ``file_cache``: parsed once per version of a file, so the
agent's five passes a second over an unchanged job cost a ``stat`` each.
"""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import uuid

from csi_driver import file_cache
from csi_driver.ramdisk import CLIENT_DIR
from replicator.local_tier import frameworks, pod_files
from replicator.local_tier.step_manifest import StepManifest
from replicator.wire.messages import JobRef, JobSettings, PodRank, abandoned, decode, extends, to_json

META_DIR = "mtc"
_MANIFEST_NAME = re.compile(r"^\d+\.json$")


@dataclasses.dataclass
class PodProgress:
    """How far the current pod of the job has come through the Orbax protocol.

    Attributes:
      pod_uid: the pod this record belongs to; another pod starts a fresh record.
      incarnation, rank, jax_coordinator: its assignment, once known.
      jax_init_written: ``jax-init-info.txt`` was written for this assignment.
      settings: the settings its ``replicator.yaml`` carried, once consumed.
      handing_over: the step whose hand-over (clearing newer steps, writing the marker) began,
        -1 for a fresh start; a replay after a crash must not clear again.
      restore_done: the restore marker was written.
    """

    pod_uid: str
    incarnation: str | None = None
    rank: int | None = None
    jax_coordinator: str | None = None
    jax_init_written: bool = False
    settings: JobSettings | None = None
    handing_over: int | None = None
    restore_done: bool = False

    def pod_rank(self, job: JobRef) -> PodRank:
        """This pod's place in ``job`` (the coordinator client's key); only once it has a rank."""
        return PodRank(job, self.incarnation, self.rank)  # type: ignore[arg-type]  # both set together, asked only after


def _parse_manifest(data: bytes) -> StepManifest:
    return StepManifest.from_json(data.decode("utf-8"))


def _parse_progress(data: bytes) -> PodProgress:
    raw = json.loads(data)
    settings = raw.pop("settings")
    return PodProgress(**raw, settings=None if settings is None else decode(settings, JobSettings))


def _parse_lineage(data: bytes) -> tuple[int, ...]:
    return tuple(int(step) for step in json.loads(data)["forks"])


# Process-wide: every JobMeta of a ramdisk shares them (the agent makes one per call).
_MANIFESTS = file_cache.DirCache(_MANIFEST_NAME.match, _parse_manifest)
_PROGRESS = file_cache.FileCache(_parse_progress)
_LINEAGE = file_cache.FileCache(_parse_lineage)
_FRAMEWORK = file_cache.FileCache(lambda data: frameworks.get(data.decode("utf-8")))


def _write_json(path: str, value) -> None:
    pod_files.write_file_atomic(path, (value if isinstance(value, str) else json.dumps(value)).encode())


class JobMeta:
    """The metadata directory of one ramdisk.

    Args:
      ramdisk_path: the ramdisk's mount point (``Ramdisk.path``).
    """

    def __init__(self, ramdisk_path: str):
        self.root = os.path.join(ramdisk_path, META_DIR)
        self.client_dir = os.path.join(ramdisk_path, CLIENT_DIR)
        self._manifests = os.path.join(self.root, "manifests")
        self._replicas = os.path.join(self.root, "replicas")
        self._incoming = os.path.join(self.root, "incoming")
        if not os.path.isdir(self._incoming):  # made last: when it exists, so do the others
            for directory in (self._manifests, self._replicas, self._incoming):
                os.makedirs(directory, exist_ok=True)

    def manifests(self) -> dict[int, StepManifest]:
        """Step -> manifest of every recorded step (the manifests are shared: do not mutate them)."""
        return {manifest.step: manifest for manifest in _MANIFESTS.read(self._manifests).values()}

    def save_manifest(self, manifest: StepManifest) -> None:
        _write_json(os.path.join(self._manifests, f"{manifest.step}.json"), manifest.to_json())

    def drop_manifest(self, step: int) -> None:
        try:
            os.unlink(os.path.join(self._manifests, f"{step}.json"))
        except FileNotFoundError:
            pass

    # -- replicas of other ranks ---------------------------------------------------------------

    def replica_dir(self, rank: int, step: int) -> str:
        return os.path.join(self._replicas, f"rank-{rank}", str(step))

    def replicas(self) -> dict[tuple[int, int], StepManifest]:
        """(rank, step) -> manifest of every complete replica held here (shared: do not mutate them)."""
        found = {}
        for rank_dir in os.listdir(self._replicas):
            for manifest in _MANIFESTS.read(os.path.join(self._replicas, rank_dir)).values():
                found[(manifest.rank, manifest.step)] = manifest
        return found

    def replica_installed_at(self, rank: int, step: int) -> float | None:
        """When the replica's manifest was written (it is installed last), wall-clock seconds; None if not held."""
        try:
            return os.stat(self.replica_dir(rank, step) + ".json").st_mtime
        except FileNotFoundError:
            return None

    def new_incoming_dir(self) -> str:
        """A fresh directory on the ramdisk for data being received; rename it into place when verified."""
        path = os.path.join(self._incoming, uuid.uuid4().hex)
        os.makedirs(path)
        return path

    def install_replica(self, verified_dir: str, manifest: StepManifest) -> None:
        """Moves a verified incoming directory into place; the manifest goes last, so a replica
        without one was never complete."""
        target = self.replica_dir(manifest.rank, manifest.step)
        self.drop_replica(manifest.rank, manifest.step)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(verified_dir, target)
        _write_json(target + ".json", manifest.to_json())

    def drop_replica(self, rank: int, step: int) -> None:
        target = self.replica_dir(rank, step)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target + ".json")
        shutil.rmtree(target, ignore_errors=True)

    def sweep_partial(self) -> None:
        """Deletes half-received data and replicas whose manifest is missing (a crash mid-push or
        mid-delete); after an agent restart nothing is still receiving them."""
        for name in os.listdir(self._incoming):
            shutil.rmtree(os.path.join(self._incoming, name), ignore_errors=True)
        for rank_dir in os.listdir(self._replicas):
            parent = os.path.join(self._replicas, rank_dir)
            for name in os.listdir(parent):
                if not name.endswith(".json") and not os.path.exists(os.path.join(parent, name + ".json")):
                    shutil.rmtree(os.path.join(parent, name), ignore_errors=True)

    def locate(self, rank: int, step: int) -> tuple[str, StepManifest] | None:
        """The directory and manifest of ``rank``'s ``step`` on this ramdisk: own data or a replica,
        never a copy of a timeline a rollback abandoned."""
        forks = self.lineage()
        own = self.manifests().get(step)
        if own is not None and own.rank == rank and not abandoned(forks, step, own.timeline):
            found = self.framework.find_step_dir(self.client_dir, step)
            if found is not None:
                return found, own
        replica = self.replicas().get((rank, step))
        if replica is not None and not abandoned(forks, step, replica.timeline):
            return self.replica_dir(rank, step), replica
        return None

    # -- the job's timeline ----------------------------------------------------------------------

    def lineage(self) -> tuple[int, ...]:
        """The job's rollbacks as this node last learnt them (``messages.in_lineage``); () before any."""
        return _LINEAGE.read(os.path.join(self.root, "lineage.json")) or ()

    def learn_lineage(self, forks: tuple[int, ...]) -> bool:
        """Records ``forks`` if they extend what this node knows; True when they did (the caller
        then deletes the copies they abandon)."""
        if not extends(tuple(forks), self.lineage()):
            return False
        _write_json(os.path.join(self.root, "lineage.json"), {"forks": list(forks)})
        return True

    # -- the job's framework -----------------------------------------------------------------------

    @property
    def framework(self) -> frameworks.Framework:
        """The framework whose files the client dir holds, as the job's volume asked for it
        (``frameworks.DEFAULT`` until a pod recorded one).

        Raises:
          frameworks.UnknownFramework: the recorded name is not registered (an agent that knows fewer).
        """
        return _FRAMEWORK.read(os.path.join(self.root, "framework")) or frameworks.get(frameworks.DEFAULT)

    def record_framework(self, framework: frameworks.Framework) -> None:
        """Records the framework of the job's newest pod, if it is not the one recorded."""
        with contextlib.suppress(frameworks.UnknownFramework):  # an unknown name is replaced
            if self.framework.name == framework.name:
                return
        pod_files.write_file_atomic(os.path.join(self.root, "framework"), framework.name.encode())

    # -- the current pod -------------------------------------------------------------------------

    def progress(self, pod_uid: str) -> PodProgress:
        """The record of ``pod_uid`` (the caller's own copy); a new, empty one when the stored record is another pod's."""
        stored = _PROGRESS.read(os.path.join(self.root, "assignment.json"))
        if stored is None or stored.pod_uid != pod_uid:
            return PodProgress(pod_uid)
        return dataclasses.replace(stored)

    def save_progress(self, progress: PodProgress) -> None:
        _write_json(os.path.join(self.root, "assignment.json"), to_json(progress))
