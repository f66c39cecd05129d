"""The grants a coordinator with ``--peer-grants`` signs into its replies (``replicator.wire.grants``).

A node is granted only what its orders and its ranks' restore views already name: a push of the copy the order
names to each of the order's targets, and a fetch of the view's step from each peer that serves it. Grants are
signed when a reply or a view goes out, not kept: the state knows nothing of them.
"""

import msgspec

from replicator.wire.grants import GrantSigner
from replicator.wire.messages import JobRef, ReportReply, RestoreView, Tier


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
    return msgspec.structs.replace(reply, replicate=orders, grant_key=signer.public_key)


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
        else source
        for source in view.sources
    )
    return msgspec.structs.replace(view, sources=sources)
