"""The workloads the tests apply to the real control plane: the README's example JobSet, and JobSets built here, as
dicts."""

import copy

import yaml

from tests.helpers import REPO

NO_PULL_IMAGE = "registry.invalid/no-kubelet-pulls-this:0"
"""An image no kubelet here pulls: the JobSet tests run pods that are only scheduled, never started."""


def jobset(name: str, *replicated: dict) -> dict:
    """JobSet ``name`` of ``replicated`` (``kube_objects.replicated``'s), to create."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {"replicatedJobs": list(replicated)},
    }


def example_jobset(image: str = NO_PULL_IMAGE) -> dict:
    """``manifests/example-jobset.yaml`` as a dict, with its placeholder image replaced."""
    document = copy.deepcopy(yaml.safe_load((REPO / "manifests" / "example-jobset.yaml").read_text()))
    for replicated in document["spec"]["replicatedJobs"]:
        for container in replicated["template"]["spec"]["template"]["spec"]["containers"]:
            container["image"] = image
    return document
