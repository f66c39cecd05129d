"""Kubernetes' own storage e2e suite against the deployed driver (``make e2e-deploy``, after the quick start):
``e2e-storage.test``, Kubernetes' ``test/e2e`` with only the storage suite's ``External Storage`` cases linked
(the Makefile's ``E2E_TEST``), built from the Kubernetes source the control plane is built from, run with
``conformance/testdriver.yaml`` (the driver's declared capabilities) on the cluster the README's quick start
installed. The driver serves CSI ephemeral inline volumes only,
so of every ``External Storage`` case the suite defines, the ``CSI Ephemeral-volume (default fs)`` ones run; the rest
skip on a capability the driver declares false or a volume type it does not serve.

Two departures, both for what the suite cannot do here: its test image (busybox) is built from this machine's Debian
``busybox-static`` and imported into each node's containerd, named by ``conformance/repo-list.yaml``; and the chart's
namespace opt-in (a ValidatingAdmissionPolicy, ``admissionPolicy.enabled``) is off while the suite runs, as the suite
makes a namespace of its own for each case and labels it with its own keys only.
"""

import os
import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO
from tests.helpers.kube.deployment import RELEASE_NAMESPACE
from tests.helpers.kube.images import applets, busybox_image
from tests.helpers.polling import wait_until

CONFORMANCE = REPO / "tests" / "deploy" / "conformance"
TESTDRIVER = CONFORMANCE / "testdriver.yaml"
REPO_LIST = CONFORMANCE / "repo-list.yaml"
BUSYBOX = "busybox:1.37.0-1"
"""The suite's default test image on Linux (test/utils/image/manifest.go), under the registry REPO_LIST names."""
PATTERN = "[Testpattern: CSI Ephemeral-volume (default fs)]"
EPHEMERAL_CASES = {
    "should create read-only inline ephemeral volume",
    "should create read/write inline ephemeral volume",
    "should support two pods which have the same volume definition",
    "should support multiple inline ephemeral volumes",
}
"""The ephemeral suite's cases for an inline volume (test/e2e/storage/testsuites/ephemeral.go)."""
SKIPS = {
    **{
        f'skipped - Driver "ramdisk.csi.mtc.dev" does not support volume type "{volume_type}" - skipping': why
        for volume_type, why in (
            ("DynamicPV", "no StorageClass: the driver provisions no PersistentVolume"),
            ("PreprovisionedPV", "no PersistentVolume: the CSIDriver serves Ephemeral volumes only"),
            ("InlineVolume", "an in-tree plugin's inline volume, not a CSI driver's"),
            ("GenericEphemeralVolume", "a PVC made from a StorageClass, which the driver has none of"),
        )
    },
    "skipped - Skipping CSIInlineVolume test for expansion": "the expansion of a generic ephemeral volume's PVC",
}
"""Every reason the suite may skip an ``External Storage`` case for, with why it does not apply to the driver: a
case that skips for another reason (a capability the suite reads, say) fails the test until it is declared here."""
SUITE_SECONDS = 1800


def e2e_test() -> Path:
    binary = Path(os.environ.get("MTC_E2E_TEST", REPO / ".tools" / "bin" / "e2e-storage.test"))
    if not binary.is_file():
        pytest.fail(f"{binary} missing: run `make e2e-deploy`, which builds it")
    return binary


@pytest.fixture(scope="module")
def suite_images(deployment, tmp_path_factory):
    """The suite's busybox, every applet linked, imported into each node's containerd as the chart's images are."""
    registry = yaml.safe_load(REPO_LIST.read_text())["promoterE2eRegistry"]
    archive = busybox_image(tmp_path_factory.mktemp("images") / "busybox.tar", f"{registry}/{BUSYBOX}", links=applets())
    for node in deployment.nodes:
        node.ctr("images", "import", "--snapshotter", node.snapshotter, str(archive))


def _admission_policy(deployment, enabled: bool) -> None:
    deployment.sh(
        f"helm upgrade mtc charts/mtc --namespace {RELEASE_NAMESPACE} --reuse-values "
        f"--set admissionPolicy.enabled={str(enabled).lower()}",
        timeout=300,
    )
    # The API server's admission follows the policy objects through an informer: a server-side dry run of a pod that
    # uses the driver in a namespace without the opt-in label says when it has.
    probe = (
        "kubectl run conformance-probe -n default --dry-run=server --restart=Never --image=unused "
        '--overrides=\'{"spec": {"volumes": [{"name": "v", "csi": {"driver": "ramdisk.csi.mtc.dev"}}]}}\''
    )
    wait_until(lambda: (deployment.sh(probe, check=False).returncode == 0) == (not enabled), 60, "the policy applied")


@pytest.fixture(scope="module")
def without_namespace_opt_in(deployment):
    _admission_policy(deployment, enabled=False)
    yield
    _admission_policy(deployment, enabled=True)


def run_suite(deployment, report: Path) -> subprocess.CompletedProcess:
    """``e2e-storage.test`` on the storage suite's ``External Storage`` cases for the driver of TESTDRIVER."""
    return subprocess.run(
        [
            str(e2e_test()),
            f"--kubeconfig={deployment.plane.kubeconfig}",
            "--provider=skeleton",
            f"--storage.testdriver={TESTDRIVER}",
            f"--kube-test-repo-list={REPO_LIST}",
            "--ginkgo.focus=External.Storage",
            f"--ginkgo.junit-report={report}",
            f"--ginkgo.timeout={SUITE_SECONDS}s",
            "--ginkgo.no-color",
        ],
        env=deployment.env,
        capture_output=True,
        text=True,
        timeout=SUITE_SECONDS + 120,
    )


def outcomes(report: Path) -> list[tuple[str, str, str]]:
    """(name, status, skip message) of each ``External Storage`` case of a Ginkgo JUnit report (two cases may share a
    name); status is ``passed``, ``skipped``, ``failed``..."""
    cases = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        if (name := case.get("name", "")).startswith("[It] External Storage"):
            skipped = case.find("skipped")
            cases.append((name, case.get("status", ""), "" if skipped is None else skipped.get("message", "")))
    return cases


def test_the_storage_e2e_suite_passes_every_ephemeral_pattern(
    deployment, suite_images, without_namespace_opt_in, capsys
):
    report = deployment.plane.workdir / "conformance-junit.xml"
    done = run_suite(deployment, report)
    log = deployment.plane.workdir / "conformance.log"
    log.write_text(done.stdout + done.stderr)
    assert report.is_file(), f"{e2e_test().name} exited {done.returncode} with no report:\n{done.stderr[-4000:]}"
    cases = outcomes(report)
    statuses = [status for _, status, _ in cases]
    with capsys.disabled():  # the summary the closing notes quote, in the run's output even where it passes
        print(
            f"\nKubernetes storage suite, External Storage: {len(cases)} cases, {statuses.count('passed')} passed, "
            f"{statuses.count('skipped')} skipped, {len(cases) - statuses.count('passed') - statuses.count('skipped')}"
            f" failed; the suite exited {done.returncode} (log: {log})"
        )
    failed = [name for name, status, _ in cases if status not in ("passed", "skipped")]
    assert not failed, f"{failed}\n{done.stdout[-6000:]}"
    unexplained = {message for _, status, message in cases if status == "skipped" and message not in SKIPS}
    assert not unexplained, unexplained
    passed = [name for name, status, _ in cases if status == "passed"]
    assert all(PATTERN in name for name in passed), passed
    assert sorted(name.rsplit("] ephemeral ", 1)[-1] for name in passed) == sorted(EPHEMERAL_CASES), passed
    assert done.returncode == 0, done.stdout[-4000:]
