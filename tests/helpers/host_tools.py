"""The programs the tests need from this machine, outside the virtualenvs and ``.tools/bin``, and the Debian
packages that provide them: the one list the Makefile installs from and its preflight checks against, so the
two cannot drift. ``tests/unit/test_host_tools.py`` fails when the tests, their helpers or the product code
they run start a program by a name that is in none of the sets below.

A *suite* is what a group of make targets needs:

- ``local``: every target that runs tests or benches on this machine's loopback: network faults
  (``tests/helpers/network.py``: iptables, tc, ss), certificates (openssl), a previous release's tree (git).
- ``etcd``: the control plane's store (``make k8s-tools``).
- ``node``: a real kubelet node (``make k8s-node-tools``): containerd and its ``ctr``, runc and the CNI
  loopback plugin that containerd starts, the static busybox the pods' images are made of.
- ``deploy``: the chart on real kubelets (``make e2e-deploy``): the image tools, the namespaces, the pod network.

``BASE`` is in every Debian system (Essential or ``Priority: required``, so in debootstrap's minbase), checked
with every suite all the same. Python interpreters (``sys.executable``, the virtualenvs') and ``GO_TOOLS`` are
started by path or found with ``find_tool``, and come from make, not Debian.

iptables: the tests rely on the nf_tables backend, the one Debian's ``iptables`` package selects by default
(``iptables`` is ``iptables-nft``), on which ``network.py``'s rules were written and the suite runs (its
``delayed`` works around how nf_tables treats a DNAT rule deleted under a connection); the preflight refuses the
legacy one (``iptables-legacy`` selected with update-alternatives).

    python3 -m tests.helpers.host_tools --packages SUITE...  # the packages of the missing tools, on one line
    python3 -m tests.helpers.host_tools --check SUITE...     # one line per missing tool and its package; exit 1

Standard library only: it runs before the virtualenv exists.
"""

import argparse
import os
import shutil
import sys

BASE = {"mount": "mount", "umount": "mount", "rm": "coreutils", "tar": "tar", "bash": "bash"}

SUITES = {
    "local": {
        "iptables": "iptables",
        "iptables-restore": "iptables",
        "tc": "iproute2",
        "ss": "iproute2",
        "openssl": "openssl",
        "git": "git",
    },
    "etcd": {"etcd": "etcd-server"},
    # runc, not crun ("cgroups in hybrid mode not supported"); busybox-static: the images hold no libraries.
    "node": {
        "containerd": "containerd",
        "ctr": "containerd",
        "runc": "runc",
        "/bin/busybox": "busybox-static",
        "/usr/lib/cni/loopback": "containernetworking-plugins",
        "ip6tables": "iptables",  # the kubelet's chains removed after it (node.py)
    },
    # The chart on real kubelets (make e2e-deploy): the images built with buildah on a debootstrapped base; each
    # node in a mount namespace of its own (unshare, nsenter), the cluster in a network namespace (unshare, ip); a
    # pod network of CNI's ptp and host-local plugins, kube-proxy's iptables rules.
    "deploy": {
        "buildah": "buildah",
        "debootstrap": "debootstrap",
        "unshare": "util-linux",
        "nsenter": "util-linux",
        "ip": "iproute2",
        "/usr/lib/cni/ptp": "containernetworking-plugins",
        "/usr/lib/cni/host-local": "containernetworking-plugins",
    },
}

GO_TOOLS = frozenset(
    {
        "csi-sanity",
        "fake-gcs-server",
        "minio",
        "helm",
        "kustomize",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kubelet",
        "kube-proxy",
        "kubectl",
        "coredns",
        "jobset",
    }
)
"""Built by ``make tools`` and ``make k8s-tools`` into ``.tools/bin`` (``tests/helpers/tools.py`` finds them)."""

_IPTABLES_NFT = "xtables-nft-multi"  # what Debian's iptables and iptables-restore resolve to with nf_tables


def _tools(suites: list[str]) -> dict[str, str]:
    return {**BASE, **{tool: package for suite in suites for tool, package in SUITES[suite].items()}}


def _present(tool: str) -> bool:
    return os.access(tool, os.X_OK) if tool.startswith("/") else shutil.which(tool) is not None


def problems(suites: list[str]) -> list[str]:
    """What is wrong with this machine for ``suites``: one line per tool, naming its package or the fix."""
    found = []
    for tool, package in _tools(suites).items():
        if not _present(tool):
            found.append(
                f"{tool}: not found{'' if tool.startswith('/') else ' on PATH'}; it comes with Debian's package {package}"
            )
        elif (
            tool.startswith("iptables")
            and os.path.basename(binary := os.path.realpath(shutil.which(tool))) != _IPTABLES_NFT
        ):
            found.append(
                f"{tool}: {binary} is not the nf_tables backend the tests rely on: "
                "update-alternatives --set iptables /usr/sbin/iptables-nft"
            )
    return found


def missing_packages(suites: list[str]) -> list[str]:
    """The Debian packages of the tools ``suites`` need that are not on this machine, each once."""
    tools = _tools(suites)
    return list(dict.fromkeys(tools[t] for t in tools if not _present(t)))


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python3 -m tests.helpers.host_tools",
        description="The programs the tests need from this machine and their Debian packages.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--packages", action="store_true", help="print the Debian packages of the missing tools, on one line"
    )
    what.add_argument(
        "--check", action="store_true", help="print a line per tool missing or wrong, naming its package; exit 1 if any"
    )
    parser.add_argument(
        "suites", nargs="+", choices=sorted(SUITES), help="what the make target runs (the base set goes with each)"
    )
    args = parser.parse_args()
    if args.packages:
        print(" ".join(missing_packages(args.suites)))
        return
    if found := problems(args.suites):
        sys.exit("\n".join(found))


if __name__ == "__main__":
    main()
