"""The backup tier: complete steps in object storage (``gs://``, ``s3://``, ``file://``).

``worker`` is the node agent's share (upload, list, restore), ``store`` the step layout and its
verification, ``backends`` picks an ``object_store.ObjectStore`` implementation by the URL's scheme.
"""
