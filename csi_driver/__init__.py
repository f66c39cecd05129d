"""What kubelet sees: the CSI node plugin (servicers, ramdisk manager, mounts, volume requests) and
the kubelet stand-in. It imports nothing from ``replicator`` or ``prefetch`` (a contract in
pyproject.toml); publish side effects reach the rest through the ramdisk manager's hook."""
