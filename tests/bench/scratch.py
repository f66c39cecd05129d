"""Free loopback ports for the benches (their scratch directories are ``examples.local_cluster.scratch_dir``)."""

import socket


def free_port(host: str) -> int:
    """A port the kernel reports free on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
