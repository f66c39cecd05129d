"""Container images built here, since none can be pulled: one layer holding Debian's static busybox, written as
an OCI image-layout archive that ``ctr images import`` reads."""

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
"""Debian's ``busybox-static``: one static binary, so the image needs no libraries."""

_APPLETS = ("sh", "sleep", "echo", "cat", "ls", "true", "env", "mount", "df", "date", "hostname")


def _blob(archive: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def applets() -> tuple[str, ...]:
    """Every applet the machine's busybox holds (``busybox --list``), as a full busybox image links them."""
    listed = subprocess.run([str(BUSYBOX), "--list"], check=True, capture_output=True, text=True, timeout=30).stdout
    return tuple(name for name in listed.split() if name != "busybox")


def _layer(links: tuple[str, ...]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as layer:
        for directory in ("bin", "etc", "tmp", "proc", "sys", "dev", "var", "local"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            layer.addfile(info)
        layer.add(str(BUSYBOX), "bin/busybox")
        for applet in links:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            layer.addfile(info)
    return buffer.getvalue()


def busybox_image(
    archive_path: Path, reference: str, entrypoint: list[str] | None = None, links: tuple[str, ...] = _APPLETS
) -> Path:
    """Writes an OCI archive of a busybox image named ``reference`` (for example ``mtc.local/busybox:1``).

    Args:
      entrypoint: the image's entrypoint; none by default (a pod gives its ``command``).
      links: the applets linked in ``/bin``; a few by default, ``applets()`` for all of them.

    Returns:
      ``archive_path``.
    """
    layer = _layer(links)
    with tarfile.open(archive_path, mode="w") as archive:
        layer_digest = _blob(archive, layer)
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], **({"Entrypoint": entrypoint} if entrypoint else {})},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }
        config_bytes = json.dumps(config).encode()
        config_digest = _blob(archive, config_bytes)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": config_digest,
                    "size": len(config_bytes),
                },
                "layers": [
                    {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": len(layer)}
                ],
            }
        ).encode()
        manifest_digest = _blob(archive, manifest)
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "annotations": {
                        "io.containerd.image.name": reference,
                        "org.opencontainers.image.ref.name": reference,
                    },
                }
            ],
        }
        for name, data in (
            ("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'),
            ("index.json", json.dumps(index).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return archive_path
