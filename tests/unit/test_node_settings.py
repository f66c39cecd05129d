"""``mtc node``'s flags become one ``NodeConfig`` in sections, built once; a kubeconfig that does not
work is refused before the coordinator starts (every other bad flag: ``test_cli_bad_input.py``)."""

import ssl

import pytest

from replicator import cli
from replicator.cli import coordinator_command, node_commands
from replicator.node.config import NodeConfig
from replicator.pacing import timing
from replicator.wire.tls import ServerCheck
from tests.helpers.kube.pki import CertificateAuthority


def test_flags_land_in_their_sections(monkeypatch, tmp_path):
    built = []
    monkeypatch.setattr(node_commands, "run_node", built.append)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
    monkeypatch.chdir(tmp_path)
    CertificateAuthority(tmp_path).pair.cert.rename("ca.pem")
    (tmp_path / "plugins_registry").mkdir()
    assert (
        cli.main(
            [
                "node",
                "--node-id",
                "n1",
                "--root",
                "/r",
                "--csi-endpoint",
                "unix:///c.sock",
                "--listen",
                "127.0.0.1:8470",
                "--backup",
                "gs://bucket/p",
                "--backup-keep",
                "5",
                "--coordinator",
                "https://c:8471",
                "--peer-tls-ca",
                "ca.pem",
                "--peer-tls-check",
                "ca",
                "--replicas",
                "2",
                "--max-nodes",
                "64",
                "--background-cpu",
                "0.5",
                "--topology",
                "zone=a",
                "--kubelet-registration-dir",
                "plugins_registry",
            ]
        )
        == 0
    )
    (config,) = built
    assert isinstance(config, NodeConfig) and (config.node_id, config.root, config.topology) == (
        "n1",
        "/r",
        {"zone": "a"},
    )
    assert (config.csi.endpoint, config.csi.max_nodes, config.csi.ramdisk_backend) == ("unix:///c.sock", 64, "tmpfs")
    assert config.csi.kubelet_registration_dir == "plugins_registry"
    assert (config.peer.listen, config.peer.replicas, config.peer.tls_ca, config.peer.url) == (
        "127.0.0.1:8470",
        2,
        "ca.pem",
        "http://127.0.0.1:8470",
    )
    assert config.peer.tls_check is ServerCheck.CA
    peers = config.peer.client_context()
    assert peers is not None and (peers.check_hostname, peers.verify_mode) == (False, ssl.CERT_REQUIRED)
    assert (config.backup.url, config.backup.keep, config.backup.storage_emulator_host) == (
        "gs://bucket/p",
        5,
        "http://127.0.0.1:4443",
    )
    assert (config.coordinator.url, config.coordinator_ca) == (
        "https://c:8471",
        "ca.pem",
    )  # the peer CA when none of its own
    assert (config.pacing.background_cpu, config.pacing.restore_deadline_seconds) == (
        0.5,
        timing.RESTORE_DEADLINE_SECONDS,
    )


def test_coordinator_kube_without_a_usable_kubeconfig_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(
        coordinator_command, "run_coordinator", lambda config: pytest.fail("the coordinator must not start")
    )
    broken = tmp_path / "kubeconfig"
    broken.write_text("apiVersion: v1\nkind: Config\n")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    argv = ["coordinator", "--listen", "127.0.0.1:1", "--insecure", "--kube"]
    assert cli.main([*argv, "--kubeconfig", str(broken)]) == 2
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"mtc coordinator: --kube: no usable API server configuration in {broken}: KeyError")
    assert lines[1].startswith(
        "mtc coordinator: --kube: no usable API server configuration in the pod's service account, $KUBECONFIG, "
        "~/.kube/config: ConfigError"
    )
    assert len(lines) == 2
