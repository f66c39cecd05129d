"""The operator's own credential, which ``mtc status`` and ``mtc restore-from`` send to the coordinator: a coordinator
with operator identity (``replicator.coordinator.trust.operator_auth``) checks it with the API server and RBAC.

It is the bearer token of the kubeconfig's user, or of its exec plugin, as lightkube loads them (in a pod, its
service account's token first; else ``$KUBECONFIG``, else ``~/.kube/config``), or the token of ``--token-file``.
A user that authenticates with a client certificate has no token to pass on: the commands then send none and say
so if the coordinator asks for one.
"""

import dataclasses

import httpx2
import yaml
from lightkube import KubeConfig
from lightkube.config.client_adapter import user_auth
from lightkube.core.exceptions import ConfigError

from replicator.wire.bearer import read_token


@dataclasses.dataclass(frozen=True)
class Credential:
    """What an operator's command sends.

    Attributes:
      token: the bearer token, or None to send none.
      source: where the token comes from, or why none is sent (for a refusal's message).
    """

    token: str | None
    source: str


_NO_TOKEN_HINT = "give --token-file with a token of yours (kubectl create token, or your identity provider's)"


def operator_credential(token_file: str | None, kubeconfig: str | None, context: str | None) -> Credential:
    """The credential to send: ``token_file``'s token, else the kubeconfig's (``kubeconfig``, else lightkube's
    search), of ``context`` (else the current one).

    Raises:
      ValueError: the token file cannot be read; the given kubeconfig or context cannot be used; the user's exec
        plugin failed, or its auth-provider is one lightkube does not run. No kubeconfig found, when none was
        given, is not an error: no token is sent.
    """
    if token_file is not None:
        try:
            return Credential(read_token(token_file), f"the token of --token-file {token_file}")
        except (OSError, ValueError) as err:
            raise ValueError(f"--token-file {token_file}: {err}") from None
    given = kubeconfig or context
    try:
        config = (KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_env()).get(context)
    except (ConfigError, OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as err:
        if given:
            raise ValueError(f"kubeconfig {kubeconfig or '(found)'}: {err}") from None
        return Credential(None, f"no token sent: no kubeconfig ({err}); give --kubeconfig, or {_NO_TOKEN_HINT}")
    assert config is not None  # get() without a default returns one or raises
    where = f"user {config.context.user!r} of kubeconfig {config.fname or '(the pod service account)'}"
    try:
        auth = user_auth(config.user)
        if auth is None:
            return Credential(None, f"no token sent: {where} has none (a client certificate); {_NO_TOKEN_HINT}")
        # The header the user's httpx auth would send the API server (an exec plugin runs here).
        header = next(auth.sync_auth_flow(httpx2.Request("GET", config.cluster.server))).headers.get("Authorization")
    except (ConfigError, OSError, KeyError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None
    scheme, _, token = (header or "").partition(" ")
    if scheme != "Bearer" or not token:
        return Credential(None, f"no token sent: {where} has none (a password); {_NO_TOKEN_HINT}")
    return Credential(token.strip(), f"the token of {where}")
