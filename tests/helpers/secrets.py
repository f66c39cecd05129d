"""A Secret's file as the kubelet projects and updates it into a pod's volume."""

import os
import shutil
import uuid


def project_secret(path: str, content: str) -> None:
    """Writes ``content`` to ``path`` the way the kubelet updates a mounted Secret: ``path`` is a symlink
    to ``..data/<name>`` in ``<path>.d``, ``..data`` a symlink to a version directory; an update writes a
    new version directory, renames a new ``..data`` over the old one (atomic) and removes the old
    version. The first call replaces a regular file at ``path`` the same way."""
    volume, name = f"{path}.d", os.path.basename(path)
    os.makedirs(volume, exist_ok=True)
    data = os.path.join(volume, "..data")
    previous = os.readlink(data) if os.path.islink(data) else None
    version = f"..{uuid.uuid4().hex}"
    os.mkdir(os.path.join(volume, version))
    with open(os.path.join(volume, version, name), "w", encoding="utf-8") as f:
        f.write(content)
    os.symlink(version, os.path.join(volume, "..data_tmp"))
    os.rename(os.path.join(volume, "..data_tmp"), data)
    if previous is not None:
        shutil.rmtree(os.path.join(volume, previous))
    if not os.path.islink(path):
        os.symlink(os.path.join(os.path.basename(volume), "..data", name), f"{path}.tmp")
        os.rename(f"{path}.tmp", path)
