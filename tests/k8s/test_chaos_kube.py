"""The chaos suite's ``kube`` variant at a fixed seed (``make chaos`` runs it with 20 random faults): a real Orbax job,
a JobSet whose pods the real controllers make, on agents that each prove their Node with their own projected
token to a coordinator running ``--kube --node-identity --peer-grants``, through a node loss (a fresh Node, its
agent pod and token registered, the lost Node deleted) and an agent SIGKILLed mid-push and restarted with its token,
each restoring the newest possible step with values identical to an uninterrupted run."""

from tests.drivers import chaos

SEED = 3


def test_kube_variant_restores_the_newest_step_through_a_node_loss_and_an_agent_restart(tmp_path):
    # Not patient: each failure's RPO sample is taken at once (stricter), so the test takes no longer.
    rows = chaos.run(SEED, 2, "kube", ["node_loss", "kill_mid_push"], str(tmp_path), patient=False)
    table = chaos.render(rows) + "\n" + chaos.summary(rows)
    print(table)
    assert len(rows) == 2 and {r.fault.split(" ")[0] for r in rows} == {"node", "SIGKILL"}, table
    assert all(row.right and row.restored is not None for row in rows), table
    # The fresh node (node-4) joined with a token of its own, and the coordinator required one of every report.
    assert (tmp_path / "node-tokens" / "node-4" / "token").read_text().count(".") == 2  # a JWT
    log = (tmp_path / "cluster" / "coordinator" / "coordinator.log").read_text()
    assert "per-node identity: reports need a token of ServiceAccount mtc-system/mtc" in log
