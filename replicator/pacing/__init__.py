"""The lowest utilities of the node agent: every timing constant, and the CPU cap on its background work."""
