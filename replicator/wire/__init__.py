"""What crosses the network between node agents and the coordinator: the messages both sides decode,
the bearer check, and the node's client of the coordinator. The coordinator imports only this."""
