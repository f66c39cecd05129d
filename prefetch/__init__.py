"""Restore pre-fetcher: pulls a node's rank shards from the fastest tier into its ramdisk before the job reads them."""
