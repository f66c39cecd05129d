"""``mtc status`` and ``mtc restore-from`` against a real coordinator process whose certificate names
only its in-cluster Service (as through ``kubectl port-forward``): ``--tls-server-name`` reaches it,
nothing else does, and refusals are one line with a non-zero exit."""

import subprocess
import sys

import pytest

from replicator.coordinator.api.status import Coordinator
from tests.helpers.kube.pki import CertificateAuthority
from tests.helpers.polling import wait_until
from tests.helpers.ports import listen_address

SERVICE_NAME = "mtc-coordinator.mtc-system.svc"


def _reachable(coordinator: Coordinator) -> bool:
    try:
        coordinator.status()
        return True
    except OSError:
        return False


@pytest.fixture
def coordinator(tmp_path):
    """A coordinator on 127.0.0.1 serving a certificate for ``SERVICE_NAME`` only; (URL, CA file, token file)."""
    (tmp_path / "pki").mkdir()
    ca = CertificateAuthority(tmp_path / "pki")
    serving = ca.issue("coordinator", "mtc-coordinator", dns_names=(SERVICE_NAME,))
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    listen = listen_address()
    with open(tmp_path / "coordinator.log", "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "replicator.cli",
                "coordinator",
                "--listen",
                listen,
                "--tls-cert",
                str(serving.cert),
                "--tls-key",
                str(serving.key),
                "--token-file",
                str(token),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"https://{listen}"
    try:
        wait_until(
            lambda: _reachable(Coordinator(url, str(ca.pair.cert), SERVICE_NAME)), 30, "the coordinator answering"
        )
        yield url, str(ca.pair.cert), str(token)
    finally:
        process.terminate()
        process.wait(timeout=10)


def mtc(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "replicator.cli", *argv],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )


def test_tls_server_name_reaches_a_coordinator_whose_certificate_names_another_host(coordinator):
    url, ca, token = coordinator
    named = ["--coordinator", url, "--ca", ca, "--tls-server-name", SERVICE_NAME]
    ok = mtc("status", *named, "--json")
    assert ok.returncode == 0 and '"jobs": []' in ok.stdout, ok.stderr
    for flags in (
        ["--coordinator", url, "--ca", ca],
        ["--coordinator", url, "--ca", ca, "--tls-server-name", "other.example"],
    ):
        refused = mtc("status", *flags)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert (
            refused.stderr.startswith(f"UNAVAILABLE: coordinator {url}:")
            and "CERTIFICATE_VERIFY_FAILED" in refused.stderr
        )
        assert ("give --tls-server-name" in refused.stderr) == ("--tls-server-name" not in flags)

    # The same reach for restore-from; an unknown job is a 404 in one line, for every command.
    for argv in (
        ["status", "--job", "default/nope"],
        ["restore-from", "--job", "default/nope", "--step", "3", "--dry-run"],
        ["restore-from", "--job", "default/nope", "--cancel", "--token-file", token],
    ):
        answer = mtc(*argv, *named)
        assert (answer.returncode, answer.stderr) == (1, "HTTP 404: no job default/nope\n"), argv
    unauthorized = mtc("restore-from", "--job", "default/nope", "--cancel", *named)
    assert unauthorized.returncode == 1 and unauthorized.stderr.startswith("HTTP 401: ")
