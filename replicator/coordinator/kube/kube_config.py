"""How the coordinator reaches the API server (``mtc coordinator --kube``): the settings and the
configuration lightkube connects with."""

import dataclasses

import yaml
from lightkube import KubeConfig
from lightkube.core.exceptions import ConfigError

from replicator.coordinator.kube.kube_shape import ShapeSettings


@dataclasses.dataclass(frozen=True)
class KubeSettings:
    """How the coordinator reads the API server (``mtc coordinator --kube``).

    Attributes:
      kubeconfig: a kubeconfig file, or None for the pod's service account (in cluster) or ``$KUBECONFIG``.
      namespace: the one namespace to watch Pods and JobSets in, or None for all.
      shape: our CSI driver's name and the node label naming a block or rack.
    """

    kubeconfig: str | None = None
    namespace: str | None = None
    shape: ShapeSettings = dataclasses.field(default_factory=ShapeSettings)


def kube_config(settings: KubeSettings) -> KubeConfig:
    """Where the API server is and how to authenticate: ``settings.kubeconfig``, else the pod's service account,
    else ``$KUBECONFIG`` or ``~/.kube/config`` (lightkube's order).

    Raises:
      ValueError: none of them is usable; the message names what was tried and why it failed.
    """
    tried = settings.kubeconfig or "the pod's service account, $KUBECONFIG, ~/.kube/config"
    try:
        config = KubeConfig.from_file(settings.kubeconfig) if settings.kubeconfig else KubeConfig.from_env()
        config.get()  # the current context: its cluster and user
        return config
    except (ConfigError, OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as err:
        raise ValueError(f"--kube: no usable API server configuration in {tried}: {err!r}") from None
