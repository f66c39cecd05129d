"""The labels that name a training job on the metrics of both processes.

They are not ``namespace`` and ``job``: Prometheus gives every scraped series its target's own
``namespace`` and ``job`` (the scraped pod's namespace, the scrape job). Ours would be renamed
``exported_namespace``/``exported_job``, or with ``honorLabels`` overwrite the target's, and a
Prometheus that sets ``overrideHonorLabels`` would silently break every rule and panel. With names
of their own they need neither.
"""

# (namespace, JobSet name) of the training job, in this order.
JOB_LABELS = ("training_namespace", "training_job")
