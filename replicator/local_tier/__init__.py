"""The local tier: what lives on one job ramdisk.

The training framework's file protocol (``frameworks``), the one way to touch the pod-writable
client dir (``pod_files``), step manifests, the agent's metadata (``job_meta``), step deletion
(``steps``) and the errors the job is told (``log_once``).
"""
