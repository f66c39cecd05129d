"""``make demo``: the node plugin's lifecycle on this machine, driven as kubelet would.

A pod of job ``demo-slice`` gets its ramdisk, writes a checkpoint, and is deleted; the node agent
is SIGKILLed and restarted; a new pod of the same job (new ``volume_id``) finds the checkpoint.
"""

import hashlib
import os
import shutil
import sys
import tempfile
import time

from csi_driver import kubelet, mounts
from examples.local_cluster import NodeAgentProcess, can_mount_tmpfs, unmount_all_below


def main() -> int:
    workdir = tempfile.mkdtemp(prefix="mtc-demo-")
    backend = "tmpfs" if can_mount_tmpfs() else "dir"
    agent = NodeAgentProcess("node-1", os.path.join(workdir, "node-1"), "127.0.0.1:18400", backend)
    attrs = {"nodes": "1", "size": "256Mi"}
    try:
        agent.start()
        print(f"node agent up: {agent.endpoint} (ramdisk backend: {backend})")
        first = os.path.join(workdir, "pods/uid-1/volumes/mount")
        volume_id = kubelet.publish(agent.endpoint, first, "demo-slice-0-0-aaaaa", attributes=attrs)
        entry = mounts.find_mount(first)
        print(f"pod 1 published: {volume_id[:16]}... at {first} ({entry.fstype if entry else 'symlink'})")
        payload = os.urandom(64 << 20)
        with open(os.path.join(first, "checkpoint.bin"), "wb") as f:
            f.write(payload)
        print(f"pod 1 wrote a 64 MiB checkpoint, sha256 {hashlib.sha256(payload).hexdigest()[:16]}")
        kubelet.unpublish(agent.endpoint, first, volume_id)
        print("pod 1 deleted (NodeUnpublishVolume)")

        agent.kill()
        print("node agent SIGKILLed")
        started = time.monotonic()
        agent.start()
        print(f"node agent restarted and ready in {time.monotonic() - started:.2f} s")

        second = os.path.join(workdir, "pods/uid-2/volumes/mount")
        kubelet.publish(agent.endpoint, second, "demo-slice-0-0-bbbbb", attributes=attrs)
        with open(os.path.join(second, "checkpoint.bin"), "rb") as f:
            survived = f.read() == payload
        print(f"pod 2 (new volume_id) published; checkpoint intact: {survived}")
        kubelet.unpublish(agent.endpoint, second)
        return 0 if survived else 1
    finally:
        agent.stop()
        unmount_all_below(workdir)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
