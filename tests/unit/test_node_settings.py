"""``mtc node``'s flags become one ``NodeConfig`` in sections, built once; flags that do not go
together are refused before anything starts."""

import pytest

from replicator import cli
from replicator.cli import coordinator_command, node_commands
from replicator.node.config import NodeConfig
from replicator.pacing import timing


def test_flags_land_in_their_sections(monkeypatch):
    built = []
    monkeypatch.setattr(node_commands, "run_node", built.append)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
    assert cli.main(["node", "--node-id", "n1", "--root", "/r", "--csi-endpoint", "unix:///c.sock", "--listen", "127.0.0.1:8470",
                     "--backup", "gs://bucket/p", "--backup-keep", "5", "--coordinator", "https://c:8471", "--peer-tls-ca", "ca.pem",
                     "--replicas", "2", "--max-nodes", "64", "--background-cpu", "0.5", "--topology", "zone=a",
                     "--kubelet-registration-dir", "/var/lib/kubelet/plugins_registry"]) == 0  # fmt: skip
    (config,) = built
    assert isinstance(config, NodeConfig) and (config.node_id, config.root, config.topology) == ("n1", "/r", {"zone": "a"})
    assert (config.csi.endpoint, config.csi.max_nodes, config.csi.ramdisk_backend) == ("unix:///c.sock", 64, "tmpfs")
    assert config.csi.kubelet_registration_dir == "/var/lib/kubelet/plugins_registry"
    assert (config.peer.listen, config.peer.replicas, config.peer.tls_ca, config.peer.url) == ("127.0.0.1:8470", 2, "ca.pem",
                                                                                               "http://127.0.0.1:8470")  # fmt: skip
    assert (config.backup.url, config.backup.keep, config.backup.storage_emulator_host) == ("gs://bucket/p", 5, "http://127.0.0.1:4443")
    assert (config.coordinator.url, config.coordinator_ca) == ("https://c:8471", "ca.pem")  # the peer CA when none of its own
    assert (config.pacing.background_cpu, config.pacing.restore_deadline_seconds) == (0.5, timing.RESTORE_DEADLINE_SECONDS)


def test_a_peer_certificate_without_its_key_is_refused_before_the_agent_starts(monkeypatch, capsys):
    built = []
    monkeypatch.setattr(node_commands, "run_node", built.append)
    assert cli.main(["node", "--node-id", "n1", "--root", "/r", "--csi-endpoint", "unix:///c.sock", "--listen", "127.0.0.1:1",
                     "--peer-tls-cert", "cert.pem"]) == 2  # fmt: skip
    assert built == [] and "--peer-tls-cert and --peer-tls-key go together" in capsys.readouterr().err


def test_coordinator_kube_without_a_usable_kubeconfig_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(coordinator_command, "run_coordinator", lambda config: pytest.fail("the coordinator must not start"))
    broken = tmp_path / "kubeconfig"
    broken.write_text("apiVersion: v1\nkind: Config\n")
    argv = ["coordinator", "--listen", "127.0.0.1:1", "--insecure", "--kube"]
    assert cli.main([*argv, "--kubeconfig", str(broken)]) == 2
    assert cli.main([*argv, "--kubeconfig", str(tmp_path / "missing")]) == 2
    assert cli.main(["coordinator", "--listen", "127.0.0.1:1", "--insecure", "--kubeconfig", str(broken)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"--kube: no usable API server configuration in {broken}: KeyError")
    assert lines[1].startswith(f"--kube: no usable API server configuration in {tmp_path / 'missing'}: ConfigError")
    assert lines[2] == "--kubeconfig and --kube-namespace need --kube"
