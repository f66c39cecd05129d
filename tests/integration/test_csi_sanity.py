"""kubernetes-csi/csi-test's csi-sanity v5.4.0 against a real ``mtc node`` (installed by ``make test``)."""

import subprocess
import xml.etree.ElementTree as ElementTree

from examples.local_cluster import can_mount_tmpfs
from tests.helpers.tools import require_tool

# Only specs that cannot apply to a node-only driver of ephemeral volumes; docs/development.md (csi-sanity) names each.
SKIPPED_SPECS = [
    "Controller Server",  # no controller service: volumes are inline, created at publish
    "should remove target path",  # provisions its volume with CreateVolume
    "should fail when volume does not exist on the specified path",  # provisions with CreateVolume
]


def test_csi_sanity_passes_against_node_agent(start_agent, tmp_path):
    agent = start_agent(backend="tmpfs" if can_mount_tmpfs() else "dir")
    report = tmp_path / "csi-sanity.xml"
    result = subprocess.run(
        [
            require_tool("csi-sanity"),
            f"--csi.endpoint={agent.endpoint}",
            f"--csi.mountdir={tmp_path / 'sanity-mount'}",
            f"--csi.stagingdir={tmp_path / 'sanity-staging'}",
            "--ginkgo.skip=" + "|".join(SKIPPED_SPECS),
            f"--ginkgo.junit-report={report}",
            "--ginkgo.no-color",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    suite = ElementTree.parse(report).getroot().find("testsuite")
    ran = int(suite.get("tests")) - int(suite.get("skipped"))
    assert int(suite.get("failures")) == 0 and int(suite.get("errors")) == 0
    assert ran >= 13, f"only {ran} csi-sanity specs ran"
