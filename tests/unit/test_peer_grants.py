"""Peer grants (replicator/wire/grants.py): what a grant allows, and every way one is refused."""

import time

import pytest

from replicator.coordinator.trust.peer_grants import with_fetch_grants, with_push_grants
from replicator.wire.grants import CLOCK_SKEW_SECONDS, GRANT_SECONDS, GrantKeys, GrantRefused, GrantSigner
from replicator.wire.messages import JobRef, ReplicateOrder, ReportReply, RestoreView, Source, Target, Tier

COPY = dict(namespace="team-a", job="llama", rank=3, step=400)


@pytest.fixture
def signer():
    return GrantSigner()


@pytest.fixture
def keys(signer):
    keys = GrantKeys()
    keys.learn(signer.public_key)
    return keys


def check(keys, grant, node="node-b", allowed=("fetch",), now=None, **copy):
    return keys.check(grant, allowed=allowed, node=node, now=now, **{**COPY, **copy})


def refusal(keys, grant, **kwargs) -> str:
    with pytest.raises(GrantRefused) as refused:
        check(keys, grant, **kwargs)
    return refused.value.reason


def test_a_grant_allows_exactly_its_copy_at_its_node(signer, keys):
    grant = signer.issue("fetch", "team-a", "llama", 3, 400, "node-a", "node-b")
    claims = check(keys, grant)
    assert (claims.op, claims.frm, claims.to, claims.kid) == ("fetch", "node-a", "node-b", signer.key_id)
    assert claims.exp == pytest.approx(time.time() + GRANT_SECONDS, abs=5)


@pytest.mark.parametrize(
    "other",
    [dict(job="other-job"), dict(namespace="team-b"), dict(rank=4), dict(step=401)],
    ids=["another job", "another namespace", "another rank", "another step"],
)
def test_a_grant_for_job_j_reads_nothing_else(signer, keys, other):
    grant = signer.issue("fetch", "team-a", "llama", 3, 400, "node-a", "node-b")
    assert refusal(keys, grant, **other) == "other copy"


def test_a_grant_cannot_be_replayed_to_another_node(signer, keys):
    grant = signer.issue("fetch", "team-a", "llama", 3, 400, "node-a", "node-b")
    assert refusal(keys, grant, node="node-c") == "other node"


def test_a_grant_expires_after_its_time_and_the_allowed_clock_skew(signer, keys):
    issued = time.time()
    grant = signer.issue("fetch", "team-a", "llama", 3, 400, "node-a", "node-b", now=issued, seconds=60)
    check(keys, grant, now=issued + 60 + CLOCK_SKEW_SECONDS - 1)
    assert refusal(keys, grant, now=issued + 60 + CLOCK_SKEW_SECONDS + 1) == "expired"


def test_a_fetch_grant_does_not_push_and_a_push_grant_reads_back_only_the_manifest(signer, keys):
    fetch = signer.issue("fetch", "team-a", "llama", 3, 400, "node-a", "node-b")
    push = signer.issue("push", "team-a", "llama", 3, 400, "node-a", "node-b")
    assert refusal(keys, fetch, allowed=("push",)) == "other operation"
    assert refusal(keys, push, allowed=("fetch",)) == "other operation"  # the files
    check(keys, push, allowed=("fetch", "push"))  # the manifest


def test_a_forged_or_altered_grant_is_refused(signer, keys):
    grant = signer.issue("fetch", "team-a", "llama", 3, 400, "node-a", "node-b")
    claims, signature = grant.split(".")
    other = GrantSigner().issue("fetch", "team-a", "llama", 3, 400, "node-a", "node-b")
    # Claims of another grant under this one's signature: the same key id, other bytes.
    swapped = signer.issue("fetch", "team-a", "llama", 3, 401, "node-a", "node-b").split(".")[0]
    assert refusal(keys, other) == "unknown key"
    assert refusal(keys, f"{swapped}.{signature}", step=401) == "bad signature"
    assert refusal(keys, "") == "missing"
    assert refusal(keys, "not-a-grant") == "malformed"
    assert refusal(keys, f"{claims}x.{signature}") == "malformed"
    assert refusal(keys, "a" * 5000 + "." + signature) == "malformed"


def test_agents_keep_the_last_two_coordinator_keys():
    first, second, third = GrantSigner(), GrantSigner(), GrantSigner()
    keys = GrantKeys()
    assert not keys.known
    for signer in (first, second, second):
        keys.learn(signer.public_key)
    grant_of = {s: s.issue("fetch", "team-a", "llama", 3, 400, "node-a", "node-b") for s in (first, second, third)}
    check(keys, grant_of[first])  # issued before a coordinator restart: good until it expires
    check(keys, grant_of[second])
    keys.learn(third.public_key)
    assert refusal(keys, grant_of[first]) == "unknown key"
    check(keys, grant_of[third])
    with pytest.raises(ValueError, match="not a base64url Ed25519 public key"):
        keys.learn("@@@")


def test_replies_and_views_grant_what_they_name_to_whom_they_name(signer, keys):
    reply = ReportReply(
        assignments=(), replicate=(ReplicateOrder("team-a", "llama", 3, 400, (Target("node-b", "https://b"),)),)
    )
    granted = with_push_grants(reply, signer, "node-a")
    assert granted.grant_key == signer.public_key
    claims = check(keys, granted.replicate[0].targets[0].grant, allowed=("push",))
    assert (claims.frm, claims.to) == ("node-a", "node-b")

    sources = (
        Source(Tier.PEER_CLOSE, "node-b", "https://b", 3),
        Source(Tier.BACKUP, "backup", None, 3),
    )
    view = with_fetch_grants(RestoreView("g1", 400, sources, False), signer, JobRef("team-a", "llama"), "node-c")
    assert check(keys, view.sources[0].grant).frm == "node-c"
    assert view.sources[1].grant is None  # the object store is not a peer
    fresh = RestoreView("g1", None, (), True)
    assert with_fetch_grants(fresh, signer, JobRef("team-a", "llama"), "node-c") is fresh
