"""``mtc doctor --agent``'s grant-key check against a real coordinator and a real node agent, both ``--peer-grants``:
it passes once the agent has learnt the coordinator's key from a report reply, fails against a coordinator whose key
the agent never learnt (one it cannot reach), and passes again after the cluster's coordinator restarts with a new key
and the agent has reported to it (keeping both keys)."""

import json
import urllib.request

from examples.local_cluster import CoordinatorProcess, self_signed_certificate
from replicator.cli import main
from tests.helpers.polling import wait_until
from tests.helpers.ports import listen_address


def _healthz(url: str, context=None) -> dict:
    with urllib.request.urlopen(f"{url}/healthz", timeout=5, context=context) as response:
        return json.load(response)


def _doctor(capsys, coordinator, agent) -> tuple[int, str]:
    """Exit status and the ``grant keys`` line of ``mtc doctor`` (and the fix under it, on a failure)."""
    code = main(["doctor", "--coordinator", coordinator.url, "--ca", coordinator.ca_file, "--agent", agent.url])
    lines = capsys.readouterr().out.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.split()[1:3] == ["grant", "keys"]]
    return code, "\n".join(lines[at : at + 2] if lines[at].startswith("FAIL") else lines[at : at + 1])


def test_doctor_finds_the_agents_grant_key_current_stale_and_current_again(
    start_cluster, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))  # the cluster's checks: one skip line
    cluster = start_cluster(nodes=1, peer_grants=True)
    coordinator, (agent,) = cluster.coordinator, cluster.agents
    first = _healthz(coordinator.url, coordinator.ssl_context())["grant_key"]
    wait_until(lambda: _healthz(agent.url)["grant_keys"] == [first], 30, "the agent learnt the coordinator's key")
    code, line = _doctor(capsys, coordinator, agent)
    assert code == 0, line
    assert line.split(None, 3)[3] == f"the agent holds the coordinator's key {first} (of 1 kept)"

    # A coordinator the agent does not report to (as one restarted where the agent cannot reach it): its key is
    # not the agent's, and doctor names both.
    other = CoordinatorProcess(
        str(tmp_path / "other"),
        listen_address(),
        ["--token-file", cluster.token_file, "--peer-grants"],
        tls=self_signed_certificate(str(tmp_path / "other-tls")),
    ).start()
    try:
        unknown = _healthz(other.url, other.ssl_context())["grant_key"]
        assert unknown != first
        code, line = _doctor(capsys, other, agent)
    finally:
        other.stop()
    assert code == 1
    assert line.startswith("FAIL  grant keys ")
    assert line.split(None, 3)[3].startswith(f"the coordinator signs with {unknown}, the agent holds {first}:")
    assert "fix: an agent learns the key from its next answered report" in line

    # The cluster's coordinator restarts with a new key: the agent's next report teaches it, and it keeps the old.
    coordinator.stop()
    coordinator.start()
    second = _healthz(coordinator.url, coordinator.ssl_context())["grant_key"]
    assert second != first
    wait_until(lambda: _healthz(agent.url)["grant_keys"] == [first, second], 30, "the agent learnt the new key")
    code, line = _doctor(capsys, coordinator, agent)
    assert code == 0 and line.endswith(f"the agent holds the coordinator's key {second} (of 2 kept)"), line
