"""What the node agent remembers about one job ramdisk, stored on the ramdisk itself.

It lives beside the pod-visible client dir (``<ramdisk>/mtc/``), so it survives an agent restart
exactly as long as the data it describes::

    mtc/manifests/<step>.json    StepManifest of each committed step in client/
    mtc/assignment.json          the current pod's incarnation, rank and progress
"""

import dataclasses
import json
import os

from replicator.messages import JobSettings
from replicator.step_manifest import StepManifest

META_DIR = "mtc"


@dataclasses.dataclass
class PodProgress:
    """How far the current pod of the job has come through the Orbax protocol.

    Attributes:
      pod_uid: the pod this record belongs to; another pod starts a fresh record.
      incarnation, rank, jax_coordinator: its assignment, once known.
      jax_init_written: ``jax-init-info.txt`` was written for this assignment.
      settings: the settings its ``replicator.yaml`` carried, once consumed.
      restore_done: the restore marker was written.
    """

    pod_uid: str
    incarnation: str | None = None
    rank: int | None = None
    jax_coordinator: str | None = None
    jax_init_written: bool = False
    settings: JobSettings | None = None
    restore_done: bool = False


def _write_json(path: str, value) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(value if isinstance(value, str) else json.dumps(value))
    os.replace(path + ".tmp", path)


class JobMeta:
    """The metadata directory of one ramdisk.

    Args:
      ramdisk_path: the ramdisk's mount point (``Ramdisk.path``).
    """

    def __init__(self, ramdisk_path: str):
        self.root = os.path.join(ramdisk_path, META_DIR)
        self._manifests = os.path.join(self.root, "manifests")
        os.makedirs(self._manifests, exist_ok=True)

    def manifests(self) -> dict[int, StepManifest]:
        """Step -> manifest of every recorded step."""
        found = {}
        for name in os.listdir(self._manifests):
            if name.endswith(".json"):
                with open(os.path.join(self._manifests, name), encoding="utf-8") as f:
                    manifest = StepManifest.from_json(f.read())
                found[manifest.step] = manifest
        return found

    def save_manifest(self, manifest: StepManifest) -> None:
        _write_json(os.path.join(self._manifests, f"{manifest.step}.json"), manifest.to_json())

    def drop_manifest(self, step: int) -> None:
        try:
            os.unlink(os.path.join(self._manifests, f"{step}.json"))
        except FileNotFoundError:
            pass

    def progress(self, pod_uid: str) -> PodProgress:
        """The record of ``pod_uid``; a new, empty one when the stored record is another pod's."""
        try:
            with open(os.path.join(self.root, "assignment.json"), encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            return PodProgress(pod_uid)
        if raw.get("pod_uid") != pod_uid:
            return PodProgress(pod_uid)
        settings = raw.pop("settings")
        return PodProgress(**raw, settings=None if settings is None else JobSettings.from_json(settings))

    def save_progress(self, progress: PodProgress) -> None:
        _write_json(os.path.join(self.root, "assignment.json"), dataclasses.asdict(progress))
