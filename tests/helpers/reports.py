"""Node reports built by hand, as an agent of this version sends them: a JobSet's pod and the report of its node.
The tests of the coordinator's state, routes and overlay build their reports here."""

from collections.abc import Iterable

from replicator.wire.messages import PROTOCOL_VERSION, HeldStep, JobRef, JobSettings, NodeReport, PodReport

JAX_COORDINATOR_PORT = 8476


def pod_report(
    key: JobRef,
    slice_index: int,
    worker: int,
    uid: str,
    incarnation: str | None = None,
    rank: int | None = None,
    settings: JobSettings | None = None,
    *,
    nodes: int,
    slices: int = 1,
    suffix: str = "x",
    published_at: float = 0.0,
    **fields,
) -> PodReport:
    """The pod at (slice, worker) of job ``key``, named as JobSet names it (``<job>-<slice>-<worker>-<suffix>``, in the
    job's DNS subdomain), its volume giving the job's shape, with the assignment and settings its node holds, if any;
    ``fields`` set the rest (``ranks_follow_data``...)."""
    return PodReport(
        namespace=key.namespace,
        job=key.job,
        pod_name=f"{key.job}-{slice_index}-{worker}-{suffix}",
        pod_uid=uid,
        slice_index=slice_index,
        worker_index=worker,
        nodes=nodes,
        slices=slices,
        jax_coordinator_port=JAX_COORDINATOR_PORT,
        subdomain=key.job,
        published_at=published_at,
        incarnation=incarnation,
        rank=rank,
        settings=settings,
        **fields,
    )


def node_report(
    node: str,
    pods: Iterable[PodReport] = (),
    held: Iterable[HeldStep] = (),
    *,
    url: str | None = None,
    pod_address: str | None = None,
    topology: dict[str, str] | None = None,
    protocol: int = PROTOCOL_VERSION,
    **fields,
) -> NodeReport:
    """Node ``node``'s report from ``url`` (``http://<node>``); ``fields`` set the rest (``has_backup``...)."""
    url = url or f"http://{node}"
    return NodeReport(node, url, pod_address, topology or {}, tuple(pods), tuple(held), protocol=protocol, **fields)
