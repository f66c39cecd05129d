"""Where a restore stages a copy from: one stager per tier behind one protocol (``base.Stager``).

``Restorer`` (``prefetch/restore.py``) asks each stager in turn whether it serves a source and has the
first that does stage it: this node's own copy (``local``), a peer's (``peer``), a rebuild from the
rank's parity group (``parity``) or the backup tier (``backup``). A new tier is a new module here and an
entry in ``for_node``.
"""

import ssl

from prefetch.stagers.backup import BackupDownload, BackupStager
from prefetch.stagers.base import Stager
from prefetch.stagers.local import LocalStager
from prefetch.stagers.parity import ParityStager
from prefetch.stagers.peer import PeerStager
from replicator.wire.bearer import Tokens


def for_node(
    node_id: str, peer_token: Tokens | None, peer_ssl: ssl.SSLContext | None, download: BackupDownload | None
) -> tuple[Stager, ...]:
    """The stagers of a node, in the order they are asked (the first that serves a source stages it).

    Args:
      node_id: this node's name (a source held here is staged in place).
      peer_token: bearer tokens of the peer tier (the current one is sent), or None to run without it.
      peer_ssl: TLS context for calls to peers, or None for the default.
      download: the backup tier's verified download, or None to run without it.
    """
    return (
        LocalStager(node_id),
        BackupStager(download),
        ParityStager(peer_token, peer_ssl),
        PeerStager(peer_token, peer_ssl),  # any other source: a peer, or this node's own replica over the peer tier
    )
