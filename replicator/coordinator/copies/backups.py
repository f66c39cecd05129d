"""Backup scheduling: which backups of a job's lineage are complete, which node lists them, which
step is backed up next and when, and the upload orders of a node."""

import logging
import secrets
from collections.abc import Callable

from replicator.coordinator.indices.job import JobState, StandIn
from replicator.coordinator.indices.liveness import Liveness, NodeState
from replicator.wire.messages import CRC32C_RESIDUE, BackedUp, BackupOrder, JobRef, files_digest, in_lineage

log = logging.getLogger(__name__)

_GIVE_UP_SECONDS = 600.0  # a chosen backup step that never completes is chosen anew
# Safe steps newer than the newest backup whose first-safe times are kept per job (``note_safe``): past it, the
# oldest two share the older time, so the lag a later backup leaves is over-, never under-stated.
_SAFE_AT_KEPT = 64
# A rank waits for its identical group's uploader, to deduplicate against its stored files, only when files of the
# same path, size and CRC32C hold at least this share of its bytes (``waits_for``).
_DEDUP_WAIT_SHARE = 0.5


def _believed(job: JobState, nodes: dict[str, NodeState]) -> list[BackedUp]:
    """The listings of known nodes of the job's current incarnation and of the one before it (a node lost after it
    committed a backup listed it last: the lister lists again only every 2 minutes)."""
    beliefs = job.beliefs
    return [
        b
        for node_id, b in job.listings.items()
        if (node_id in beliefs.members or node_id in beliefs.former) and node_id in nodes
    ]


def listed(job: JobState, nodes: dict[str, NodeState]) -> bool:
    """Whether a listing of the job's backups is believed: False after every node that listed them
    was lost (a cluster loss) until a new lister lists, when the backups are unknown, not gone."""
    return bool(_believed(job, nodes))


def complete(job: JobState, nodes: dict[str, NodeState]) -> dict[int, int]:
    """Step -> timeline of the complete backups of the job's lineage, by the newest listing of a
    known node the job ran on (the newest timeline if a step was backed up in several)."""
    listings = _believed(job, nodes)
    if not listings:
        return {}
    found: dict[int, int] = {}
    for step, timeline in sorted(max(listings, key=lambda b: b.listed_at).steps):
        if in_lineage(job.forks, step, timeline):
            found[step] = timeline
    return found


def note_seen(job: JobState, backed: set[int], now: float) -> None:
    """Records when this coordinator first saw each complete backup of ``backed`` (``JobState.backup_seen``),
    forgetting those no longer listed. Listings carry steps, not commit times: a backup that committed
    before this coordinator started is dated by its first listing here."""
    seen = job.backup_seen
    if seen.keys() == backed:
        return
    for step in backed.difference(seen):
        seen[step] = now
    for step in set(seen).difference(backed):
        del seen[step]


def choose_lister(job: JobState, liveness: Liveness) -> str | None:
    """The one node that lists the job's backups: rank 0's node if it can, else the lowest
    rank's live node with a backup tier, else any live node with the job's pods."""
    incarnation, lister = job.incarnation, job.decided.lister
    nodes = incarnation.nodes if incarnation is not None else {node for _, node in job.pods.values()}
    if lister in nodes and lister in liveness.backup_nodes and liveness.is_live(lister):
        return lister  # stable while it can: a new lister lists again
    able = [n for n in liveness.backup_nodes.intersection(nodes) if liveness.is_live(n)]
    order = incarnation.rank_of_node.get if incarnation is not None else None
    return min(able, key=lambda n: (order(n), n) if order else n, default=None)


def advance(
    key: JobRef,
    job: JobState,
    liveness: Liveness,
    backed: set[int],
    newest_complete: Callable[[], int | None],
) -> None:
    """Finishes the pending backup once listed complete (``backed``); starts the next one when due, in the same pass
    (a pass later, the next backup would start a heartbeat late and the lag a cluster loss leaves would grow by it).

    A pending backup keeps its upload tag (``job.backup_attempt``) through later incarnations, so what was uploaded
    before a preemption counts, until an incarnation restores an older step (the job will write it again): it is
    given up then. A rank whose node was replaced and holds no copy of the step's own data is uploaded by a live node
    holding its replica, or referenced by the node of a data-parallel peer holding the step in the same bytes
    (``stand_ins``), so a node lost mid-backup costs that rank's upload, not the backup; one that no order can finish
    any more (neither) is given up at once for a newer complete step; one that stays
    incomplete for ``_GIVE_UP_SECONDS`` whatever the reason is given up too.

    Args:
      newest_complete: called for the newest step every rank holds on nodes (not in backups).
    """
    now = liveness.now
    if job.backup_pending is not None:
        pending = job.backup_pending
        if pending in backed:
            log.info("job %s: step %d backed up", key, pending)
            job.last_backup_time, job.last_backup_chosen_at = now, job.backup_pending_since
            job.backup_pending, job.backup_stand_ins = None, {}
            # (falls through: the next backup is chosen in this pass)
        else:
            # Only once a newer step is complete (the fresh node restored it): before, a rank's node that holds no
            # copy may just not have reported yet, and its replica would be uploaded twice.
            newest = newest_complete()
            found = stand_ins(job, pending, liveness) if newest is not None and newest > pending else {}
            if _given_up(key, job, pending, found, newest, now):
                job.backup_pending, job.backup_stand_ins = None, {}
            else:
                _note_stand_ins(key, job, pending, found or {})
                return
    if job.decided.lister is None or job.incarnation is None:
        return  # no live node of the job has a backup tier: a chosen step would only be kept from GC
    newest = newest_complete()
    last = max(backed, default=None)
    if newest is None or (last is not None and newest <= last) or newest in job.rewritten:
        return
    settings = next(iter(job.settings.values()))
    if settings.backup_interval_steps is not None:
        due = last is None or newest >= last + settings.backup_interval_steps
    else:
        assert settings.backup_interval_minutes is not None  # exactly one of the two is set
        chosen = job.last_backup_chosen_at
        due = chosen is None or now - chosen >= settings.backup_interval_minutes * 60
    if due and not stranded_ranks(job, newest):
        job.backup_pending, job.backup_pending_since = newest, now
        job.backup_attempt = f"{job.incarnation.incarnation_id}-{secrets.token_hex(4)}"
        log.info("job %s: backing up step %d", key, newest)


def _given_up(
    key: JobRef, job: JobState, pending: int, found: dict[int, StandIn] | None, newest: int | None, now: float
) -> bool:
    """Whether the pending backup of ``pending`` is given up (and why, logged): the job restored an older step, a
    rank's node holds no copy of it and no live node a replica (``found`` is None) while a newer step is complete, or
    ``_GIVE_UP_SECONDS`` passed."""
    if _restored_before(job, pending):
        # The job will write the step again, perhaps in other bytes: what was uploaded of it must never commit.
        log.warning("job %s: the job restored a step older than %d; its backup is given up", key, pending)
    elif found is None:
        log.warning(
            "job %s: backup of step %d cannot complete (rank %d's node holds no copy of it, no live node a replica or "
            "a data-parallel peer's copy in its bytes); "
            "choosing anew (newest complete step: %d)",
            key,
            pending,
            stranded_ranks(job, pending)[0],
            newest,
        )
    elif now - job.backup_pending_since > _GIVE_UP_SECONDS:
        log.warning("job %s: backup of step %d did not complete; choosing anew", key, pending)
    else:
        return False
    return True


def _restored_before(job: JobState, step: int) -> bool:
    """Whether an incarnation after the one that chose the backup of ``step`` restores an older step (or starts
    fresh): the one way the job writes ``step`` anew, while uploads tagged for the backup may be stored already."""
    incarnation = job.incarnation
    chosen_in = job.backup_attempt.rpartition("-")[0]  # the tag: "<incarnation id>-<random>"
    if incarnation is None or incarnation.incarnation_id == chosen_in or incarnation.plan is None:
        return False
    return incarnation.plan.step is None or incarnation.plan.step < step


def stranded_ranks(job: JobState, step: int) -> tuple[int, ...]:
    """The ranks whose node in the current incarnation holds no copy of their own data of ``step`` (the node was
    replaced and restored another step): their own node cannot upload them. Memoized per claim change of the step
    and incarnation: a 10,000-rank job's pass walks its ranks only when either changed."""
    incarnation = job.incarnation
    if incarnation is None:
        return ()
    memo_key = (step, job.claims.step_stamps.get(step), incarnation.incarnation_id)
    if job.memo.stranded is not None and job.memo.stranded[0] == memo_key:
        return job.memo.stranded[1]
    # ClaimIndex.of: node -> whether its copy is a replica; False is the rank's own data.
    found = tuple(
        rank
        for rank, node_id in incarnation.node_of_rank.items()
        if job.claims.of(step, rank).get(node_id) is not False
    )
    job.memo.stranded = (memo_key, found)
    return found


def stand_ins(job: JobState, step: int, liveness: Liveness) -> dict[int, StandIn] | None:
    """Who uploads each stranded rank of ``step`` (``stranded_ranks``) in its node's place: the first, by node id, of
    the live nodes with a backup tier that hold a replica of it (a verified copy of the rank's own bytes, so the
    backup is the one the rank wrote); with none, the node of a data-parallel peer holding the step in the rank's
    bytes (``_identical_peer``). {} when no rank is stranded; None when one has neither (no order can upload it: a
    copy only in parity shards or on a silent node is not uploaded)."""
    found: dict[int, StandIn] = {}
    for rank in stranded_ranks(job, step):
        holders = sorted(
            node_id
            for node_id, replica in job.claims.of(step, rank).items()
            if replica and node_id in liveness.backup_nodes and liveness.is_live(node_id)
        )
        stand_in = StandIn(holders[0]) if holders else _identical_peer(job, step, rank, liveness)
        if stand_in is None:
            return None
        found[rank] = stand_in
    return found


def _identical_peer(job: JobState, step: int, rank: int, liveness: Liveness) -> StandIn | None:
    """The node and rank of the first, by rank, of ``rank``'s data-parallel peers that were found identical to it at
    ``step`` (``Identity.identical_peers``: equal signatures of the step's structure) AND whose own node reported
    the step with exactly ``rank``'s checksums (every path, size and CRC32C), and whose node in the current
    incarnation holds that copy, is live and has a backup tier. The structure alone does not make the bytes equal:
    Orbax's peers write their arrays to per-process files of other bytes, and a rank's backup must hold what it wrote.
    None when no peer qualifies, or when a file of the rank's has the CRC32C residue (it ends with its own CRC32C:
    an equal CRC32C says nothing of its bytes)."""
    incarnation = job.incarnation
    mine = job.owners.checksums(step, rank)
    if incarnation is None or not mine or any(crc == CRC32C_RESIDUE for _, crc in mine.values()):
        return None
    for peer in sorted(job.identity.identical_peers(step, rank)):
        node_id = incarnation.node_of_rank.get(peer)
        if (
            node_id is not None
            and job.claims.of(step, peer).get(node_id) is False
            and node_id in liveness.backup_nodes
            and liveness.is_live(node_id)
            and job.owners.checksums(step, peer) == mine
        ):
            return StandIn(node_id, peer)
    return None


def _note_stand_ins(key: JobRef, job: JobState, step: int, found: dict[int, StandIn]) -> None:
    """Sets the pending backup's stand-ins, logging each new one."""
    for rank, stand_in in found.items():
        if job.backup_stand_ins.get(rank) == stand_in:
            continue
        if stand_in.peer is None:
            what = "uploads its replica"
        else:
            what = f"references rank {stand_in.peer}'s upload for it (identical, with the same checksums)"
        log.warning(
            "job %s: backup of step %d: rank %d's node holds no copy of it; %s %s", key, step, rank, stand_in.node, what
        )
    job.backup_stand_ins = found


def note_safe(job: JobState, backed: set[int], now: float) -> None:
    """Records when this coordinator first found each safe step newer than the newest backup (``job.safe_at``), for
    :func:`lag`; forgets those the backups caught up with. Called once per decision pass, after the safe step."""
    newest_backup = max(backed, default=None)
    for step in [s for s in job.safe_at if newest_backup is not None and s <= newest_backup]:
        del job.safe_at[step]
    safe = job.decided.safe
    if safe is not None and (newest_backup is None or safe > newest_backup):
        job.safe_at.setdefault(safe, now)
    if len(job.safe_at) > _SAFE_AT_KEPT:  # a long store outage: merge the oldest into the next, keeping its time
        oldest = min(job.safe_at)
        since = job.safe_at.pop(oldest)
        following = min(job.safe_at)
        job.safe_at[following] = min(job.safe_at[following], since)


def lag(job: JobState, backed: set[int], now: float) -> tuple[int, float] | None:
    """How far what a cluster loss would restore (the newest complete backup) is behind the newest safe step.

    Returns:
      (steps, seconds): the safe step minus the newest backup's step (the whole safe step with none), and the seconds
      since the oldest safe step newer than the newest backup was found safe; (0, 0.0) when the newest safe step is
      backed up; None before any step is safe.
    """
    safe = job.decided.safe
    if safe is None:
        return None
    newest_backup = max(backed, default=None)
    if newest_backup is not None and safe <= newest_backup:
        return 0, 0.0
    since = min(job.safe_at.values(), default=now)
    return safe - (newest_backup or 0), now - since


def orders(key: JobRef, job: JobState, state: NodeState, shared: bool = False) -> list[BackupOrder]:
    """Uploads of the step being backed up for the ranks whose own data this node holds, and for the ranks it stands
    in for (``JobState.backup_stand_ins``: it holds their replica, or a data-parallel peer's own copy in their bytes,
    while their own node holds no copy).

    The members of a data-parallel group found identical share the upload (``shared``: each sends
    its share of the files and references the others', ``backup_tier.shared_upload``); else one
    member (rotating with the step) uploads and the others reference its objects. Either way each
    uploads only what differs besides. A member a peer stands in for is left out of its group: it
    uploads no share, and its manifest references the peer's upload once that is stored.
    """
    incarnation = job.incarnation
    step = job.backup_pending
    if incarnation is None or step is None:
        return []
    node_id = state.report.node_id
    result = []
    for claim in state.claims:
        if claim.job != key or claim.step != step:
            continue
        if claim.replica:
            if job.backup_stand_ins.get(claim.rank) == StandIn(node_id):
                result.append(_order(key, job, claim.rank, shared))
        elif incarnation.node_of_rank.get(claim.rank) == node_id:
            result.append(_order(key, job, claim.rank, shared))
            result += [
                _order(key, job, rank, shared, data_rank=claim.rank)
                for rank, stand_in in sorted(job.backup_stand_ins.items())
                if stand_in == StandIn(node_id, claim.rank)
            ]
    return result


def waits_for(job: JobState, step: int, rank: int, uploader: int) -> bool:
    """Whether ``rank``'s upload of ``step`` waits for ``uploader``'s (its identical group's, ``orders``) to reference
    its stored files: when files of the same path, size and CRC32C as the uploader's, the most deduplication could
    skip, hold at least ``_DEDUP_WAIT_SHARE`` of the rank's bytes, or while either rank's checksums are unknown. Ranks
    found identical in structure may hold other bytes (Orbax writes each process's arrays to files of its own,
    ``ocdbt.process_<i>/``): waiting for them put a whole upload before the rank's, every backup taking two uploads'
    time. Not waiting sends the few equal bytes again, the backup's contents the same. Kept in ``LeaderMemo.waits``
    once both ranks' checksums are known."""
    memo = job.memo.leaders
    if (known := memo.waits.get((rank, uploader))) is not None:
        return known
    mine, theirs = job.owners.checksums(step, rank), job.owners.checksums(step, uploader)
    if mine is None or theirs is None:
        return True
    same = sum(entry[0] for path, entry in mine.items() if theirs.get(path) == entry)
    memo.waits[rank, uploader] = waits = same >= _DEDUP_WAIT_SHARE * sum(size for size, _ in mine.values())
    return waits


def _order(key: JobRef, job: JobState, rank: int, shared: bool, data_rank: int | None = None) -> BackupOrder:
    """The upload order of ``rank``'s copy of the pending backup (``orders``); ``data_rank``: a peer's own copy
    stands in for it (``BackupOrder.data_rank``)."""
    incarnation, step = job.incarnation, job.backup_pending
    assert incarnation is not None and step is not None  # orders' caller checked
    protected: tuple[int, ...] = (
        (incarnation.plan.step,) if incarnation.plan and incarnation.plan.step is not None else ()
    )
    if job.forced_step is not None:
        protected += (
            job.forced_step,
        )  # a rollback's step: kept from retention until its restore is done or it is cancelled
    if data_rank is not None:
        mine = job.owners.checksums(step, rank)
        digest = files_digest(mine) if mine is not None else None
        sharing: tuple[int, ...] = ()
        leader = data_rank
    else:
        referenced = {r for r, stand_in in job.backup_stand_ins.items() if stand_in.peer is not None}
        group = tuple(r for r in job.memo.leaders.group(job.identity, step, rank) if r not in referenced)
        sharing = group if shared and len(group) > 1 else ()
        leader = rank if sharing else group[step % len(group)]
        leader = leader if leader == rank or waits_for(job, step, rank, leader) else rank
        digest = None
    return BackupOrder(
        key.namespace,
        key.job,
        step,
        rank,
        job.backup_attempt,
        len(incarnation.node_of_rank),
        None if leader == rank else leader,
        protected,
        len(job.forks),
        job.forks,
        sharing,
        data_rank,
        digest,
    )
