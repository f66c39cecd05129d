"""One node's process (``mtc node``): the composition, the replicator loop, and the save path's pieces."""
