"""The grants a coordinator with ``--peer-grants`` signs into its replies (``replicator.wire.grants``).

A node is granted only what its orders and its ranks' restore views already name: a push of the copy the order
names to each of the order's targets, a fetch of the view's step from each peer that serves it, and for parity
(``coordinator.parity``) a fetch of each group member's step an encode or a decode reads, and a read of each
parity shard a decode reads. Grants are
signed when a reply or a view goes out, not kept: the state knows nothing of them.
"""

import msgspec

from replicator.wire.grants import GrantSigner
from replicator.wire.messages import JobRef, MemberCopy, ParityRecipe, ReportReply, RestoreView, Tier


def with_push_grants(reply: ReportReply, signer: GrantSigner, node_id: str) -> ReportReply:
    """``reply`` to ``node_id`` with a push grant in each replicate order's targets, and the signer's key."""
    orders = tuple(
        msgspec.structs.replace(
            order,
            targets=tuple(
                msgspec.structs.replace(
                    target,
                    grant=signer.issue(
                        "push", order.namespace, order.job, order.rank, order.step, node_id, target.node
                    ),
                )
                for target in order.targets
            ),
        )
        for order in reply.replicate
    )
    encodes = tuple(
        msgspec.structs.replace(
            order, members=_member_grants(order.members, signer, order.namespace, order.job, order.step, node_id)
        )
        for order in reply.encode
    )
    return msgspec.structs.replace(reply, replicate=orders, encode=encodes, grant_key=signer.public_key)


def _member_grants(
    members: tuple[MemberCopy, ...], signer: GrantSigner, namespace: str, job: str, step: int, node_id: str
) -> tuple[MemberCopy, ...]:
    """Each member read from a node, with a fetch grant of its step there for ``node_id``."""
    return tuple(
        msgspec.structs.replace(m, grant=signer.issue("fetch", namespace, job, m.rank, step, node_id, m.node))
        if m.node is not None
        else m
        for m in members
    )


def _recipe_grants(recipe: ParityRecipe, signer: GrantSigner, key: JobRef, step: int, node_id: str) -> ParityRecipe:
    """A decode's recipe with grants: a fetch of each live member's step, a read of each parity shard."""
    group = recipe.members[0].rank
    return msgspec.structs.replace(
        recipe,
        members=_member_grants(recipe.members, signer, key.namespace, key.job, step, node_id),
        shards=tuple(
            msgspec.structs.replace(
                s, grant=signer.issue("parity", key.namespace, key.job, group, step, node_id, s.node)
            )
            for s in recipe.shards
        ),
    )


def with_fetch_grants(view: RestoreView, signer: GrantSigner, key: JobRef, node_id: str) -> RestoreView:
    """``view`` for the rank on ``node_id`` with a fetch grant in each source a peer serves."""
    if view.step is None:
        return view
    step = view.step
    sources = tuple(
        msgspec.structs.replace(
            source,
            grant=signer.issue("fetch", key.namespace, key.job, source.data_rank, step, node_id, source.holder),
        )
        if source.tier != Tier.BACKUP and source.url
        else msgspec.structs.replace(source, recipe=_recipe_grants(source.recipe, signer, key, step, node_id))
        if source.recipe is not None
        else source
        for source in view.sources
    )
    return msgspec.structs.replace(view, sources=sources)
