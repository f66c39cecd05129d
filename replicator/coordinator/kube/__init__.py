"""The API server's view (``--kube``): job shapes computed from Pods, Nodes and JobSets (``kube_shape``), watched
(``kube_watch``), laid over node reports (``kube_overlay``), and how to connect (``kube_config``); and what the API
server is told: restores as Events (``restore_events``), the nodes' notices as Warning events (``node_notices``),
both through client-go's correlation (``kube_events``), and each job's protection as JobSet annotations
(``jobset_annotations``). Those two read the coordinator's state; the view itself imports no other part of it.
"""
