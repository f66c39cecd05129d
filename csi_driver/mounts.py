"""The kernel's mount table and the mount operations the ramdisk needs (tmpfs, bind, remount).

Mount operations shell out to util-linux ``mount``/``umount``: their error messages are the ones
an SRE already knows, and the table is read back from ``/proc/self/mountinfo`` (proc(5)).
"""

import dataclasses
import os
import subprocess


class MountError(OSError):
    """A mount or unmount command failed; the message carries the command's stderr."""


@dataclasses.dataclass(frozen=True)
class MountEntry:
    """One line of ``/proc/self/mountinfo``.

    Attributes:
      mount_point: absolute path where the filesystem is mounted.
      root: the path inside the source filesystem that is mounted (``/client`` for a bind of a
        subdirectory, ``/`` otherwise).
      fstype: e.g. ``tmpfs``.
      options: per-mount and per-superblock options merged, e.g. ``{"size": "1048576k", "rw": ""}``.
    """

    mount_point: str
    root: str
    fstype: str
    options: dict[str, str]


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _parse_options(*fields: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for field in fields:
        for item in field.split(","):
            key, _, value = item.partition("=")
            options[key] = value
    return options


def mount_table(path: str = "/proc/self/mountinfo") -> list[MountEntry]:
    """Returns every mount in this process's mount namespace, in mount order."""
    entries = []
    with open(path, encoding="utf-8") as table:
        for line in table:
            fields = line.split()
            separator = fields.index("-")
            entries.append(
                MountEntry(
                    mount_point=_unescape(fields[4]),
                    root=_unescape(fields[3]),
                    fstype=fields[separator + 1],
                    options=_parse_options(fields[5], fields[separator + 3]),
                )
            )
    return entries


def find_mount(mount_point: str) -> MountEntry | None:
    """Returns the topmost mount at exactly ``mount_point``, or None."""
    mount_point = os.path.realpath(mount_point)
    found = None
    for entry in mount_table():
        if entry.mount_point == mount_point:
            found = entry
    return found


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise MountError(f"{' '.join(argv)} failed: {result.stderr.strip() or result.returncode}")


def mount_tmpfs(mount_point: str, size_bytes: int) -> None:
    """Mounts a tmpfs of exactly ``size_bytes`` (rounded up by the kernel to whole pages)."""
    _run("mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "mtc-ramdisk", mount_point)


def resize_tmpfs(mount_point: str, size_bytes: int) -> None:
    """Changes a mounted tmpfs's size limit in place; the data stays (``mount -o remount``).

    Raises:
      MountError: the kernel refused, e.g. a size below the bytes in use.
    """
    _run("mount", "-o", f"remount,size={size_bytes}", mount_point)


def bind_mount(source: str, target: str, readonly: bool = False) -> None:
    """Bind-mounts directory ``source`` onto ``target``; read-only binds need a second remount."""
    _run("mount", "--bind", source, target)
    if readonly:
        _run("mount", "-o", "remount,bind,ro", target)


def unmount(mount_point: str) -> None:
    """Unmounts ``mount_point``."""
    _run("umount", mount_point)
