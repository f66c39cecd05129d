"""The Helm chart rendered by the real ``helm`` (``make tools``), and the pieces of its objects tests look at."""

import subprocess
from pathlib import Path

import yaml

from tests.helpers import REPO
from tests.helpers.tools import require_tool

CHART = REPO / "charts" / "mtc"
# Oldest: ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1) is GA from 1.30.
# Newest: the newest schema set kubernetes-validate 1.37.0 ships.
KUBERNETES_VERSIONS = ["1.30.0", "1.37.0"]


def run(argv: list[str]) -> str:
    """``argv``'s standard output; fails the test (with its output) when it exits non-zero."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def docs(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def template_argv(
    *settings: str,
    values: Path | None = None,
    kube_version: str = KUBERNETES_VERSIONS[0],
    namespace: str = "mtc-system",
    kubeconfig: Path | None = None,
) -> list[str]:
    """``helm template`` of the chart as release ``mtc`` in ``namespace``, with ``--set`` ``settings``
    and an optional values file; with ``kubeconfig``, its ``lookup``s ask that cluster (``--dry-run=server``)."""
    argv = [
        require_tool("helm"),
        "template",
        "mtc",
        str(CHART),
        "--namespace",
        namespace,
        "--kube-version",
        kube_version,
    ]
    if values is not None:
        argv += ["--values", str(values)]
    if kubeconfig is not None:
        argv += ["--kubeconfig", str(kubeconfig), "--dry-run=server"]
    for setting in settings:
        argv += ["--set", setting]
    return argv


def helm_template(
    *settings: str,
    values: Path | None = None,
    kube_version: str = KUBERNETES_VERSIONS[0],
    namespace: str = "mtc-system",
    kubeconfig: Path | None = None,
) -> list[dict]:
    """The chart's objects, rendered as ``template_argv`` says."""
    return docs(
        run(
            template_argv(
                *settings, values=values, kube_version=kube_version, namespace=namespace, kubeconfig=kubeconfig
            )
        )
    )


def by_key(objects: list[dict]) -> dict[tuple[str, str], dict]:
    """Objects by (kind, name); fails when two share both."""
    keyed = {(d["kind"], d["metadata"]["name"]): d for d in objects}
    assert len(keyed) == len(objects), "two objects share a kind and name"
    return keyed


def pod_spec(obj: dict) -> dict:
    """The pod spec of a workload (its template's) or of a Pod."""
    return obj["spec"]["template"]["spec"] if obj["kind"] != "Pod" else obj["spec"]


def container(obj: dict, name: str) -> dict:
    return next(c for c in pod_spec(obj)["containers"] if c["name"] == name)


def argv_of(container: dict) -> list[str]:
    return [str(a) for a in container.get("command", []) + container.get("args", [])]


def flag(argv: list[str], name: str) -> str | None:
    """The value after ``name`` in ``argv``, or None when it is absent."""
    return argv[argv.index(name) + 1] if name in argv else None
