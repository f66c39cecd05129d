"""Checkpoint steps on disk, as a training pod or a peer leaves them: the one set of factories."""

import os

from replicator.local_tier.step_manifest import StepManifest, build_manifest


def write_tree(directory, files: dict[str, bytes]) -> str:
    """Writes ``files`` (relative path -> content) below ``directory``, creating what is missing; returns it."""
    for rel, data in files.items():
        path = os.path.join(directory, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return str(directory)


def read_tree(directory) -> dict[str, bytes]:
    """Relative path -> content of every file below ``directory``."""
    found = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(parent, name), "rb") as f:
                found[os.path.relpath(os.path.join(parent, name), directory)] = f.read()
    return found


def write_step(directory, step: int, rank: int, files: dict[str, bytes]) -> tuple[str, StepManifest]:
    """Writes ``files`` below ``directory`` and checksums them as rank ``rank``'s step ``step``."""
    return str(directory), build_manifest(write_tree(directory, files), step, rank)


def commit_step(client_dir, step: int, files: dict[str, bytes]) -> str:
    """What Orbax does: writes ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>``; returns the step dir."""
    tmp = write_tree(os.path.join(client_dir, f"{step}.orbax-checkpoint-tmp"), files)
    committed = os.path.join(client_dir, str(step))
    os.rename(tmp, committed)
    return committed


def flip_byte(path, offset: int | None = None) -> str:
    """Flips one byte of ``path`` (a file, or the largest file below a directory) at ``offset``, by
    default in its middle; returns the file."""
    victim = (
        path
        if os.path.isfile(path)
        else max((os.path.join(d, f) for d, _, files in os.walk(path) for f in files), key=os.path.getsize)
    )
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2 if offset is None else offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return victim
