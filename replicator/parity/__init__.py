"""Erasure-coded RAM copies: the code (``codec``), how a group's steps map onto stripes (``layout``), the parity
objects a node holds (``store``), and the two halves that build parity and rebuild a lost rank from it
(``encoder``, ``decoder``), both reading members' bytes over the peer tier (``reads``)."""
