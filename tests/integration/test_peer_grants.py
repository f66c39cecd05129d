"""The peer service with ``--peer-grants`` over real HTTP on loopback: the coordinator's grants, and nothing
else, open a copy; a grant for job J reads nothing of job K, is refused at another node, and expires."""

import time

import pytest
from prometheus_client import REGISTRY

from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.step_manifest import build_manifest
from replicator.peer_tier.client import PeerFetchError, fetch_manifest, fetch_step, push_step
from replicator.peer_tier.grant_check import PeerGrants
from replicator.peer_tier.protocol import UPLOAD_HEADER
from replicator.wire.grants import CLOCK_SKEW_SECONDS, GRANT_HEADER, GrantKeys, GrantSigner
from tests.helpers.peer import AUTH, JOB, NS, TOKEN, commit_own_step
from tests.helpers.steps import read_tree, write_tree

FILES = {"state/a": b"job j's weights" * 1000, "meta.json": b"{}"}
OTHER_JOB = "other-job"
OTHER_FILES = {"state/a": b"job k's weights, never to be read with j's grant"}


@pytest.fixture
def signer():
    return GrantSigner()


@pytest.fixture
def grants_at(signer):
    """Node id -> the peer service's grant check of that node, having learnt the coordinator's key."""

    def make(node: str) -> PeerGrants:
        keys = GrantKeys()
        keys.learn(signer.public_key)
        return PeerGrants(keys, node)

    return make


@pytest.fixture
async def node_b(serve, grants_at, tmp_path):
    """Node b's agent: job J's step 5 (rank 0) and job K's step 5, served only against grants to node-b."""
    peer = await serve(
        str(tmp_path / "b" / "j"), grants=grants_at("node-b"), other_jobs={(NS, OTHER_JOB): str(tmp_path / "b" / "k")}
    )
    commit_own_step(peer.meta, 5, 0, FILES)
    commit_own_step(JobMeta(str(tmp_path / "b" / "k")), 5, 0, OTHER_FILES)
    return peer


def refusals(reason: str) -> float:
    return REGISTRY.get_sample_value("mtc_peer_grant_refusals_total", {"reason": reason}) or 0.0


async def status_and_reason(session, url, grant=None, method="GET", **kwargs):
    headers = {**AUTH, **({GRANT_HEADER: grant} if grant else {}), **kwargs.pop("headers", {})}
    async with session.request(method, url, headers=headers, **kwargs) as response:
        body = await response.json()
        return response.status, body.get("reason")


async def test_a_fetch_grant_reads_its_copy_bit_for_bit(node_b, signer, session, tmp_path):
    grant = signer.issue("fetch", NS, JOB, 0, 5, "node-a", "node-b")
    manifest = await fetch_manifest(session, node_b.base_url, TOKEN, NS, JOB, 0, 5, grant)
    dest = tmp_path / "fetched"
    dest.mkdir()
    await fetch_step(node_b.base_url, TOKEN, NS, JOB, manifest, str(dest), grant=grant)
    assert read_tree(str(dest)) == FILES


async def test_the_cluster_token_alone_opens_nothing_and_listing_is_refused(node_b, session):
    before = refusals("missing")
    status, reason = await status_and_reason(session, node_b.url(f"{NS}/{JOB}/ranks/0/steps/5/manifest"))
    assert (status, reason) == (403, "missing")
    status, reason = await status_and_reason(session, node_b.url(f"{NS}/{JOB}/ranks/0/steps/5/files/state/a"))
    assert (status, reason) == (403, "missing")
    assert refusals("missing") == before + 2
    assert await status_and_reason(session, node_b.url(f"{NS}/{JOB}/steps")) == (403, "no listing")
    # Without the token, the grant is not even looked at.
    grant_free = node_b.url(f"{NS}/{JOB}/ranks/0/steps/5/manifest")
    async with session.get(grant_free) as response:
        assert response.status == 401


async def test_a_grant_for_job_j_cannot_fetch_job_k(node_b, signer, session):
    grant = signer.issue("fetch", NS, JOB, 0, 5, "node-a", "node-b")
    for path in ("manifest", "files/state/a"):
        status, reason = await status_and_reason(session, node_b.url(f"{NS}/{OTHER_JOB}/ranks/0/steps/5/{path}"), grant)
        assert (status, reason) == (403, "other copy")
    with pytest.raises(PeerFetchError, match="HTTP 403"):
        await fetch_manifest(session, node_b.base_url, TOKEN, NS, OTHER_JOB, 0, 5, grant)


async def test_a_grant_cannot_be_replayed_to_another_node(serve, grants_at, signer, session, tmp_path):
    node_c = await serve(str(tmp_path / "c"), grants=grants_at("node-c"))
    commit_own_step(node_c.meta, 5, 0, FILES)  # node c holds the same copy
    grant = signer.issue("fetch", NS, JOB, 0, 5, "node-a", "node-b")
    status, reason = await status_and_reason(session, node_c.url(f"{NS}/{JOB}/ranks/0/steps/5/files/state/a"), grant)
    assert (status, reason) == (403, "other node")


async def test_a_grant_expires(node_b, signer, session):
    issued = time.time() - 120 - CLOCK_SKEW_SECONDS
    grant = signer.issue("fetch", NS, JOB, 0, 5, "node-a", "node-b", now=issued, seconds=60)
    status, reason = await status_and_reason(session, node_b.url(f"{NS}/{JOB}/ranks/0/steps/5/manifest"), grant)
    assert (status, reason) == (403, "expired")


async def test_a_push_needs_a_push_grant_for_that_step(node_b, signer, session, tmp_path):
    source = write_tree(str(tmp_path / "source"), FILES)
    manifest = build_manifest(source, 7, 1)
    fetch_grant = signer.issue("fetch", NS, JOB, 1, 7, "node-a", "node-b")
    with pytest.raises(PeerFetchError, match="HTTP 403"):
        await push_step(session, node_b.base_url, TOKEN, NS, JOB, source, manifest, grant=fetch_grant)
    other_step = signer.issue("push", NS, JOB, 1, 6, "node-a", "node-b")
    with pytest.raises(PeerFetchError, match="HTTP 403"):
        await push_step(session, node_b.base_url, TOKEN, NS, JOB, source, manifest, grant=other_step)
    assert node_b.incoming() == []  # refused before a byte was written

    push = signer.issue("push", NS, JOB, 1, 7, "node-a", "node-b")
    await push_step(session, node_b.base_url, TOKEN, NS, JOB, source, manifest, grant=push)
    # The pusher reads back what it pushed with the same grant; the files stay closed to it.
    assert await fetch_manifest(session, node_b.base_url, TOKEN, NS, JOB, 1, 7, push) == manifest
    status, reason = await status_and_reason(session, node_b.url(f"{NS}/{JOB}/ranks/1/steps/7/files/meta.json"), push)
    assert (status, reason) == (403, "other operation")


async def test_a_put_with_a_forged_grant_is_refused_before_its_body_is_read(node_b, signer, session):
    forged = GrantSigner().issue("push", NS, JOB, 1, 9, "node-a", "node-b")
    status, reason = await status_and_reason(
        session,
        node_b.url(f"{NS}/{JOB}/ranks/1/steps/9/files/x"),
        forged,
        method="PUT",
        data=b"x" * 1000,
        headers={UPLOAD_HEADER: "ab" * 8, "X-MTC-Step-Bytes": "1000"},
    )
    assert (status, reason) == (403, "unknown key")
    assert node_b.incoming() == []
