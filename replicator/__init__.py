"""The node agent and the coordinator, by concern along the data path (the layers, top to bottom):

- ``cli``: ``mtc``, the one console script.
- ``node``: one node's process: the composition, the replicator loop and the save path's pieces
  (pod hand-shake, commit detection, reports, pushes, garbage collection).
- ``prefetch`` (its own top-level package): the restore path.
- ``peer_tier`` and ``backup_tier``: the two remote tiers, each with both of its halves.
- ``local_tier``: what lives on one job ramdisk: the framework's file protocol, symlink-safe I/O in
  the pod's directory, step manifests, the agent's metadata, step deletion.
- ``wire`` and ``pacing``: the messages both processes share (and the coordinator's client), the
  bearer check; the timing constants and the CPU cap.
- ``coordinator``: its own process; it imports only ``wire``.
"""
