"""The API server's view (``--kube``): job shapes computed from Pods, Nodes and JobSets (``kube_shape``), watched
(``kube_watch``), laid over node reports (``kube_overlay``), and how to connect (``kube_config``). Read-only; it
imports no other part of the coordinator.
"""
