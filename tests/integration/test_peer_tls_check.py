"""What a node agent's peer TLS context accepts (``--peer-tls-check``), through real handshakes over
loopback TCP: ``ca`` takes any certificate of the peer CA whatever address it names (the chart's one
certificate for every agent) and nothing of another CA; ``name`` also wants the peer's address."""

import contextlib
import socket
import ssl
import threading

import pytest

from replicator.node.config import PeerSettings
from replicator.wire import tls
from replicator.wire.tls import ServerCheck
from tests.helpers.kube.pki import CertificateAuthority, KeyPair


@pytest.fixture
def pki(tmp_path) -> dict[str, KeyPair]:
    """The peer CA, its shared certificate (a name, no address), one for the address, and another CA's."""
    (tmp_path / "peers").mkdir()
    (tmp_path / "other").mkdir()
    peers, other = CertificateAuthority(tmp_path / "peers", "mtc-peer-ca"), CertificateAuthority(tmp_path / "other")
    return {
        "ca": peers.pair,
        "shared": peers.issue("shared", "mtc-node", dns_names=("mtc-node",)),
        "for_address": peers.issue("addressed", "mtc-node", ips=("127.0.0.1",)),
        "other_ca": other.issue("other", "mtc-node", dns_names=("mtc-node",), ips=("127.0.0.1",)),
    }


def handshake(served: KeyPair, client: ssl.SSLContext | None) -> str:
    """The TLS version of a handshake with a server of ``served`` at 127.0.0.1, reached by its address
    as a peer is (its pod IP).

    Raises:
      ssl.SSLCertVerificationError: the client refused the server's certificate.
    """
    server = tls.server_context(str(served.cert), str(served.key))
    assert server is not None and client is not None

    def serve(listener: socket.socket) -> None:
        connection, _ = listener.accept()
        with connection, contextlib.suppress(ssl.SSLError, OSError):  # the client's refusal, as an alert
            server.wrap_socket(connection, server_side=True).close()

    with socket.create_server(("127.0.0.1", 0)) as listener:
        served_thread = threading.Thread(target=serve, args=(listener,))
        served_thread.start()
        try:
            with (
                socket.create_connection(listener.getsockname(), timeout=10) as raw,
                client.wrap_socket(raw, server_hostname="127.0.0.1") as connection,
            ):
                return str(connection.version())
        finally:
            served_thread.join(10)


def test_ca_check_accepts_the_peer_cas_certificate_for_another_name(pki):
    context = tls.client_context(str(pki["ca"].cert), ServerCheck.CA)
    assert context is not None and (context.check_hostname, context.verify_mode) == (False, ssl.CERT_REQUIRED)
    assert handshake(pki["shared"], context) == "TLSv1.3"


def test_ca_check_refuses_a_certificate_of_another_ca_that_names_the_address(pki):
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer certificate"):
        handshake(pki["other_ca"], tls.client_context(str(pki["ca"].cert), ServerCheck.CA))


def test_name_check_refuses_the_shared_certificate_and_takes_one_for_the_address(pki):
    context = tls.client_context(str(pki["ca"].cert))
    with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
        handshake(pki["shared"], context)
    assert handshake(pki["for_address"], context) == "TLSv1.3"


def test_ca_check_needs_a_ca_of_its_own(pki):
    # The system's CAs would pass any public certificate, for any name, as a peer.
    with pytest.raises(ValueError, match="needs a CA bundle"):
        tls.client_context(None, ServerCheck.CA)
    with pytest.raises(ValueError, match="--peer-tls-check ca needs --peer-tls-ca"):
        PeerSettings(listen="127.0.0.1:8470", tls_check=ServerCheck.CA)
    peers = PeerSettings(listen="127.0.0.1:8470", tls_ca=str(pki["ca"].cert), tls_check=ServerCheck.CA)
    assert handshake(pki["shared"], peers.client_context()) == "TLSv1.3"
