"""What the query routes ask of the coordinator's state changes nothing in it: ``GET /v1/status``
(``operator.status``), ``GET .../restore-from`` (``operator.preview``), ``GET /metrics`` (``cluster_gauges``), a
restore view asked again (``GET .../restore`` once planned), a long poll's reply again (``reply_for``) and the
read-only API the tests and the service read. Each is called on a real state fed real reports (an ``xor:4`` job
that lost a rank: decode sources, shards, parity orders) and the state's whole structure is compared before and
after. A cache a query needs is kept where the state changes (the decision pass), not in the query.
"""

import dataclasses
import enum
from collections.abc import Callable

import msgspec
import pytest

from replicator.coordinator.api import cluster_gauges
from replicator.coordinator.state import ClusterState
from replicator.wire.messages import Tier
from tests.unit.test_parity_coordinator import KEY, STEP, Job, encoded_job, lose, single

_PLAIN = (int, float, str, bytes, bool, type(None), enum.Enum)


def dump(value: object, path: tuple[int, ...] = ()) -> object:
    """A deep structural copy of ``value`` in plain values: mappings as ordered pairs, sets sorted, structs,
    dataclasses and objects as their fields; a function by its name; an object met again on the path as a marker."""
    if isinstance(value, _PLAIN):
        return value
    if id(value) in path:
        return ("<cycle>", type(value).__name__)
    path = (*path, id(value))
    if isinstance(value, dict):
        return [(dump(k, path), dump(v, path)) for k, v in value.items()]
    if isinstance(value, list | tuple):
        return [dump(v, path) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(repr(dump(v, path)) for v in value)
    if isinstance(value, msgspec.Struct):
        return (type(value).__name__, [dump(getattr(value, f), path) for f in value.__struct_fields__])
    if dataclasses.is_dataclass(value):
        return (type(value).__name__, [dump(getattr(value, f.name), path) for f in dataclasses.fields(value)])
    if callable(value) and not hasattr(value, "__dict__"):
        return ("<callable>", getattr(value, "__qualname__", type(value).__name__))
    fields = dict(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        fields.update({s: getattr(value, s) for s in getattr(cls, "__slots__", ()) if hasattr(value, s)})
    return (type(value).__name__, {name: dump(v, path) for name, v in sorted(fields.items())})


def unchanged(state: ClusterState, query: Callable[[], object]) -> object:
    before = dump(state)
    answer = query()
    assert dump(state) == before, "the query changed the coordinator's state"
    return answer


@pytest.fixture
def lost_rank() -> tuple[ClusterState, Job, int]:
    """An xor:4 job that lost n3: its rank restores from a decode of its three survivors and their shards."""
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=30.0)
    state.expire(0.0)
    job = encoded_job(state)
    rank = lose(state, job, ["n3"])
    view = state.restore.view(KEY, job.incarnation, rank, 70.0)  # plans, once: a change
    assert any(s.tier == Tier.DECODE and s.recipe is not None for s in view.sources)
    return state, job, rank


def test_the_operators_queries_change_nothing(lost_rank):
    state, _, _ = lost_rank
    status = unchanged(state, lambda: state.operator.status([KEY]))
    assert [j.namespace + "/" + j.job for j in status.jobs] == [f"{KEY.namespace}/{KEY.job}"]
    assert unchanged(state, lambda: state.operator.status()) == status
    preview = unchanged(state, lambda: state.operator.preview(KEY, STEP))
    assert preview.step == STEP
    assert b"mtc_" in unchanged(state, lambda: cluster_gauges.exposition(state))


def test_a_restore_view_asked_again_changes_nothing_and_reads_the_decode_recipe(lost_rank):
    state, job, rank = lost_rank
    first = state.restore.view(KEY, job.incarnation, rank, 70.0)
    again = unchanged(state, lambda: state.restore.view(KEY, job.incarnation, rank, 70.0))
    assert again == first
    (decode,) = [s for s in again.sources if s.tier == Tier.DECODE]
    assert decode.recipe is not None and sorted(m.node for m in decode.recipe.members if m.node) == ["n0", "n1", "n2"]


def test_a_reply_again_changes_nothing_even_when_the_parity_groups_kept_are_stale():
    state = ClusterState(node_timeout_seconds=15.0, holder_grace_seconds=30.0)
    state.expire(0.0)
    job = Job(state, single(4))
    orders = job.round(1.0)  # every node holds step 5, none its shards yet
    memo = state.jobs[KEY].memo
    assert state.jobs[KEY].decided.round == STEP and all(orders.values())
    for node in job.slot:
        kept = unchanged(state, lambda node=node: state.reply_for(node))
        memo.groups_for = None  # as between a change and the pass that deals again: the reply must not deal
        assert unchanged(state, lambda node=node: state.reply_for(node)) == kept
        state.decide(KEY)  # the pass keeps the deal again
        assert memo.groups_for is not None


def test_the_read_only_api_changes_nothing(lost_rank):
    state, _, _ = lost_rank
    for query in (
        lambda: state.job_keys(),
        lambda: state.copies(KEY),
        lambda: state.copies(KEY, with_backups=False, live_only=True),
        lambda: state.backed_up(KEY),
        lambda: state.newest_complete_step(KEY),
        lambda: state.safe_step(KEY),
        lambda: state.identical(KEY),
        lambda: state.backup_lag(KEY, state.backed_up(KEY)),
        lambda: state.recovery_records(),
        lambda: state.recovery_stamp(),
        lambda: [getattr(state.job(KEY), name) for name in dir(state.job(KEY)) if not name.startswith("_")],
    ):
        unchanged(state, query)
