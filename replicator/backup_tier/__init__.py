"""The backup tier: complete steps in object storage (``gs://``, ``s3://``, ``file://``).

``worker`` is the node agent's share (upload, list, restore), ``store`` the backup logic (commit, restore,
retention) over ``layout`` (object names, rank manifests) and ``transfers`` (a rank's files, deduplicated up
and verified down), ``backends`` picks an ``object_store.ObjectStore`` implementation by the URL's scheme.
"""
