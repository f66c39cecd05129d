"""What the tests, the chaos runner and the benches share; no test module imports another.

- ``fixtures``: the pytest fixtures (agents, clusters, object stores, a peer service), registered for
  every layer by ``tests/conftest.py``.
- ``servers``: fake-gcs-server and MinIO as processes; ``tools``: the Go tools and the root check; ``host_tools``:
  the programs from Debian's packages, which make installs and checks.
- ``ports``: the one port allocator; ``polling``: the one ``wait_until``.
- ``steps``: files, steps and their manifests on disk; ``agents``: an agent's metrics, a pod's rank and the Orbax
  hand-shake driven by hand; ``ramdisks``: volume requests; ``peer``: a peer service in the test's own event loop;
  ``reports``: node reports built by hand, the one builder of ``PodReport`` and ``NodeReport``; ``jobs``: real
  training jobs;
  ``nemo_client``: a NeMo job's files through the Resiliency library, as a process or as functions;
  ``releases``: the previous release's source tree, to run beside this one, and the restarts between the two.

The processes themselves (coordinator, node agents, training pods) run through
``examples/local_cluster.py``: ``make demo`` runs the same harness, so it stays a user-facing example.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root (manifests, charts, examples)."""
