"""The save path and the cluster view: commit detection, peer replication, backup, and the coordinator."""
