"""Erasure-coded RAM copies: the code (``codec``), how a group's steps map onto stripes (``layout``), and the two
halves that build parity and rebuild a lost rank from it (``encoder``, ``decoder``), both reading members' bytes
over the peer tier (``reads``). The parity shards a node holds are ``replicator.local_tier.parity_shards``'."""
