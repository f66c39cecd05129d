"""``mtc doctor`` (replicator/cli/doctor_command.py, doctor_checks.py): the screen, and each local check's verdict
against real inputs (a mountinfo file, a token file, a coordinator-like HTTP server with its own clock, a store)."""

import base64
import email.utils
import http.server
import json
import threading
import time

import pytest

from replicator.cli import main
from replicator.cli.doctor_checks import Outcome, Verdict, coordinator, data_dir, failed, node_token
from replicator.cli.doctor_command import render

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
def clocked_server():
    """Factory: ``clocked_server(skew)`` -> the URL of an HTTP server whose clock is ``skew`` s ahead."""
    servers = []

    def start(skew: float) -> str:
        handler = type("Handler", (_Clocked,), {"skew": skew})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


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
