"""``mtc doctor`` (replicator/cli/doctor_command.py, doctor_checks.py): the screen, and each local check's verdict
against real inputs (a mountinfo file, a token file, a coordinator-like HTTP server with its own clock, a store, the
``/healthz`` bodies of a coordinator's real grant signer and an agent's real grant keys)."""

import base64
import email.utils
import http.server
import json
import threading
import time

import msgspec
import pytest

from replicator.cli import main
from replicator.cli.doctor_checks import (
    Outcome,
    Verdict,
    coordinator,
    data_dir,
    failed,
    grant_keys,
    grant_keys_verdict,
    node_token,
)
from replicator.cli.doctor_command import render
from replicator.wire.grants import GrantKeys, GrantRefused, GrantSigner
from replicator.wire.operator import Health

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:5 / /var/lib/kubelet rw,relatime shared:7 - ext4 /dev/sda1 rw
31 22 0:6 / /opt/private rw,relatime - ext4 /dev/sdb1 rw
"""


def test_render_lines_up_the_checks_puts_each_fix_under_its_failure_and_counts():
    verdicts = [
        Verdict("driver registered on node-1", Outcome.OK, "CSINode lists ramdisk.csi.mtc.dev"),
        Verdict("clock skew", Outcome.FAIL, "+45 s against the coordinator (to 1 s)", "sync this node's clock"),
        Verdict("cluster", Outcome.SKIP, "no API server configuration"),
    ]
    assert render(verdicts).splitlines() == [
        "ok    driver registered on node-1  CSINode lists ramdisk.csi.mtc.dev",
        "FAIL  clock skew                   +45 s against the coordinator (to 1 s)",
        "                                   fix: sync this node's clock",
        "skip  cluster                      no API server configuration",
        "1 of 3 checks failed",
    ]
    assert failed(verdicts) and not failed([verdicts[0], verdicts[2]])
    assert render(verdicts[:1]).splitlines()[-1] == "all 1 checks passed"


def test_data_dir_is_shared_below_the_kubelets_root_and_not_on_a_private_mount(tmp_path):
    (tmp_path / "mountinfo").write_text(MOUNTINFO)
    mountinfo = str(tmp_path / "mountinfo")
    [good] = data_dir("/var/lib/kubelet/plugins/ramdisk.csi.mtc.dev/data", mountinfo)
    assert (good.outcome, good.detail) == (Outcome.OK, "on /var/lib/kubelet, shared")
    [bad] = data_dir("/opt/private/mtc", mountinfo)
    assert (bad.outcome, bad.detail) == (Outcome.FAIL, "on /opt/private, not shared")
    assert "Bidirectional" in bad.fix


def _token(tmp_path, claims: dict) -> str:
    def part(data: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")

    path = tmp_path / "token"
    path.write_text(f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln")
    return str(path)


def test_node_token_current_expired_and_unreadable(tmp_path):
    path = _token(tmp_path, {"exp": 1000, "aud": ["mtc-coordinator"]})
    [current] = node_token(path, now=400.0)
    assert (current.outcome, current.detail) == (Outcome.OK, f"{path}: expires in 600 s")
    [expired] = node_token(path, now=1030.0)
    assert (expired.outcome, expired.detail) == (Outcome.FAIL, f"{path}: expired 30 s ago")
    [missing] = node_token(str(tmp_path / "none"))
    assert missing.outcome is Outcome.FAIL and "No such file" in missing.detail


class _Clocked(http.server.BaseHTTPRequestHandler):
    """Answers every GET with 200 and a ``Date`` header ``skew`` seconds ahead of this machine's clock."""

    skew = 0.0

    def do_GET(self) -> None:  # the stdlib's name
        self.send_response(200)  # sends Date from date_time_string
        self.end_headers()

    def date_time_string(self, timestamp=None) -> str:
        return email.utils.formatdate(time.time() + self.skew, usegmt=True)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def serve():
    """Factory: ``serve(handler_class)`` -> the URL of a stdlib HTTP server on loopback running it; all stopped."""
    servers = []

    def start(handler: type[http.server.BaseHTTPRequestHandler]) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def clocked_server(serve):
    """Factory: ``clocked_server(skew)`` -> the URL of an HTTP server whose clock is ``skew`` s ahead."""
    return lambda skew: serve(type("Handler", (_Clocked,), {"skew": skew}))


def test_coordinator_answers_and_its_clock_within_30_s_passes_beyond_fails(clocked_server):
    reached, skew = coordinator(clocked_server(0.0), None)
    assert reached.outcome is Outcome.OK and skew.outcome is Outcome.OK
    _, ahead = coordinator(clocked_server(45.0), None)
    assert ahead.outcome is Outcome.FAIL
    assert ahead.detail.startswith(("+44 s", "+45 s", "+46 s")), ahead.detail
    assert "sync this node's clock" in ahead.fix


def test_an_unreachable_coordinator_fails_with_its_fix():
    [down] = coordinator("http://127.0.0.1:9", None)
    assert down.outcome is Outcome.FAIL and "Connection refused" in down.detail
    assert "port-forward" in down.fix


def test_doctor_exit_code_is_1_on_a_failure_and_0_when_all_pass(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    assert main(["doctor", "--backup", f"file://{tmp_path}/store"]) == 0
    out = capsys.readouterr().out
    assert "ok    backup store" in out and out.splitlines()[-1] == "all 2 checks passed"  # the cluster skipped
    (tmp_path / "file").write_text("")
    assert main(["doctor", "--backup", f"file://{tmp_path}/file"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  backup store" in out and "fix: does the bucket exist" in out


def test_doctor_refuses_an_s3_endpoint_without_an_s3_backup_in_one_line(capsys):
    assert main(["doctor", "--s3-endpoint-url", "http://127.0.0.1:9000"]) == 2
    assert capsys.readouterr().err == "mtc doctor: --s3-endpoint-url http://127.0.0.1:9000: needs an s3:// --backup\n"


class _Healthz(http.server.BaseHTTPRequestHandler):
    """Answers ``GET /healthz`` with ``status`` and the JSON ``body`` (bytes, or a callable making them)."""

    status = 200
    body: object = b"{}"

    def do_GET(self) -> None:  # the stdlib's name
        body = self.body() if callable(self.body) else self.body
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def healthz_server(serve):
    """Factory: ``healthz_server(body, status=200)`` -> the URL of an HTTP server answering ``/healthz`` so."""

    def start(body, status: int = 200) -> str:
        handler = type("Handler", (_Healthz,), {"body": staticmethod(body) if callable(body) else body})
        handler.status = status
        return serve(handler)

    return start


def _coordinator_healthz(signer: GrantSigner | None) -> bytes:
    """The coordinator's ``/healthz`` body (its route's struct), with or without ``--peer-grants``."""
    return msgspec.json.encode(Health(True, signer.key_id if signer else None))


def _agent_healthz(keys: GrantKeys | None):
    """The agent's ``/healthz`` body as it is when asked: its keys as the report loop has learnt them by then."""
    return lambda: json.dumps({"node": "node-a", "ready": True, "grant_keys": keys.key_ids if keys else None}).encode()


def _grant(signer: GrantSigner) -> str:
    return signer.issue("fetch", "ns", "job", 0, 10, "node-b", "node-a")


def _accepts(keys: GrantKeys, grant: str) -> bool:
    try:
        keys.check(grant, allowed=("fetch",), namespace="ns", job="job", rank=0, step=10, node="node-a")
    except GrantRefused:
        return False
    return True


def test_grant_keys_pass_while_the_agent_holds_the_key_the_coordinator_signs_with_now(healthz_server):
    signer, keys = GrantSigner(), GrantKeys()
    keys.learn(signer.public_key)
    url = healthz_server(_coordinator_healthz(signer))
    agent = healthz_server(_agent_healthz(keys))
    [current] = grant_keys(url, None, agent, None)
    assert (current.outcome, current.detail) == (
        Outcome.OK,
        f"the agent holds the coordinator's key {signer.key_id} (of 1 kept)",
    )
    assert _accepts(keys, _grant(signer))
    # The coordinator restarted with a new key, which the agent has not learnt (no answered report since): the
    # grants it issues now are refused there, and doctor says so.
    restarted = GrantSigner()
    url = healthz_server(_coordinator_healthz(restarted))
    [stale] = grant_keys(url, None, agent, None)
    assert not _accepts(keys, _grant(restarted))
    assert stale.outcome is Outcome.FAIL
    assert stale.detail == (
        f"the coordinator signs with {restarted.key_id}, the agent holds {signer.key_id}: it refuses the grants "
        "the coordinator issues now"
    )
    assert "coordinator unreachable" in stale.fix
    # Its next answered report teaches it the key; it keeps the last two, so the old grants stay good until they
    # expire.
    keys.learn(restarted.public_key)
    [learnt] = grant_keys(url, None, agent, None)
    assert learnt.outcome is Outcome.OK and learnt.detail.endswith("(of 2 kept)")
    assert _accepts(keys, _grant(restarted)) and _accepts(keys, _grant(signer))


def test_grant_keys_verdicts_of_each_side_with_and_without_peer_grants():
    signer = GrantSigner()
    nothing_learnt = grant_keys_verdict(signer.key_id, [])
    assert nothing_learnt.outcome is Outcome.FAIL and "the agent holds no key" in nothing_learnt.detail
    unsigned = grant_keys_verdict(None, [signer.key_id])
    assert unsigned.outcome is Outcome.FAIL and "signs none" in unsigned.detail and "--peer-grants" in unsigned.fix
    assert grant_keys_verdict(None, None) == Verdict("grant keys", Outcome.SKIP, "peer grants are off")
    unchecked = grant_keys_verdict(signer.key_id, None)
    assert (unchecked.outcome, unchecked.detail) == (
        Outcome.SKIP,
        "the agent serves peers without grants (its --peer-grants is off)",
    )


def test_grant_keys_read_a_wedged_agents_503_and_skip_an_agent_that_does_not_say(healthz_server):
    signer, keys = GrantSigner(), GrantKeys()
    keys.learn(signer.public_key)
    url = healthz_server(_coordinator_healthz(signer))
    [wedged] = grant_keys(url, None, healthz_server(_agent_healthz(keys), status=503), None)
    assert wedged.outcome is Outcome.OK
    [older] = grant_keys(url, None, healthz_server(b'{"node": "node-a", "ready": true}'), None)
    assert (older.outcome, older.detail) == (
        Outcome.SKIP,
        "the agent's /healthz names no keys (an agent older than this check)",
    )
    [down] = grant_keys(url, None, "http://127.0.0.1:9", None)
    assert down.outcome is Outcome.FAIL and "Connection refused" in down.detail and "--agent" in down.fix
    [no_coordinator] = grant_keys("http://127.0.0.1:9", None, "http://127.0.0.1:9", None)
    assert no_coordinator.outcome is Outcome.SKIP and "does not answer" in no_coordinator.detail


def test_doctor_with_agent_exits_1_on_a_stale_key_and_0_on_the_current_one(
    healthz_server, capsys, monkeypatch, tmp_path
):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    signer, keys = GrantSigner(), GrantKeys()
    url, agent = healthz_server(_coordinator_healthz(signer)), healthz_server(_agent_healthz(keys))
    assert main(["doctor", "--coordinator", url, "--agent", agent]) == 1
    out = capsys.readouterr().out
    assert "FAIL  grant keys" in out and "fix: an agent learns the key from its next answered report" in out
    keys.learn(signer.public_key)
    assert main(["doctor", "--coordinator", url, "--agent", agent]) == 0
    assert "ok    grant keys" in capsys.readouterr().out


def test_doctor_refuses_an_agent_without_coordinator_or_its_ca_in_one_line(capsys):
    assert main(["doctor", "--agent", "http://127.0.0.1:8470"]) == 2
    assert (
        capsys.readouterr().err
        == "mtc doctor: --agent http://127.0.0.1:8470: needs --coordinator (whose grant key it checks)\n"
    )
    assert main(["doctor", "--coordinator", "http://127.0.0.1:9", "--agent", "https://127.0.0.1:8470"]) == 2
    assert capsys.readouterr().err == "mtc doctor: --agent https://127.0.0.1:8470: an https:// agent needs --agent-ca\n"
