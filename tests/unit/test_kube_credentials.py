"""What ``mtc status`` and ``mtc restore-from`` send as the operator's credential (``kube_credentials``): the token of
the kubeconfig's user, of its token file or of its exec plugin, loaded by lightkube from real kubeconfig files; none
for a client certificate, with the reason kept for the refusal's message."""

import json
import sys

import pytest
import yaml

from replicator.cli.kube_credentials import operator_credential


def kubeconfig(path, user: dict, context: str = "c") -> str:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "ops", "user": user}],
        "contexts": [{"name": context, "context": {"cluster": "c", "user": "ops"}}],
        "current-context": context,
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_the_kubeconfigs_token_its_token_file_or_its_exec_plugins_is_sent(tmp_path):
    given = operator_credential(None, kubeconfig(tmp_path / "token", {"token": "abc.def"}), None)
    assert given.token == "abc.def" and given.source == f"the token of user 'ops' of kubeconfig {tmp_path / 'token'}"
    (tmp_path / "file").write_text("from-a-file\n")
    assert operator_credential(
        None, kubeconfig(tmp_path / "tf", {"tokenFile": str(tmp_path / "file")}), None
    ).token == ("from-a-file")
    credential = {"apiVersion": "client.authentication.k8s.io/v1beta1", "status": {"token": "from-a-plugin"}}
    plugin = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": sys.executable,
        "args": ["-c", f"print({json.dumps(json.dumps(credential))})"],
    }
    assert operator_credential(None, kubeconfig(tmp_path / "exec", {"exec": plugin}), None).token == "from-a-plugin"


def test_token_file_wins_and_kubeconfig_is_found_as_kubectl_finds_it(tmp_path, monkeypatch):
    (tmp_path / "cluster-token").write_text("the-cluster-token\nan-older-one\n")
    found = kubeconfig(tmp_path / "found", {"token": "from-env"})
    monkeypatch.setenv("KUBECONFIG", found)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    chosen = operator_credential(str(tmp_path / "cluster-token"), None, None)
    assert (chosen.token, chosen.source) == (
        "the-cluster-token",
        f"the token of --token-file {tmp_path / 'cluster-token'}",
    )
    assert operator_credential(None, None, None).token == "from-env"
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    none = operator_credential(None, None, None)
    assert (
        none.token is None and none.source.startswith("no token sent: no kubeconfig") and "--token-file" in none.source
    )


def test_a_client_certificate_sends_nothing_and_says_why(tmp_path):
    path = kubeconfig(tmp_path / "cert", {"client-certificate": "/x.crt", "client-key": "/x.key"})
    none = operator_credential(None, path, None)
    assert none.token is None
    assert none.source == (
        f"no token sent: user 'ops' of kubeconfig {path} has none (a client certificate); give --token-file with a "
        "token of yours (kubectl create token, or your identity provider's)"
    )


@pytest.mark.parametrize(
    ("user", "context", "error"),
    [
        ({"token": "t"}, "elsewhere", "Context 'elsewhere' not found"),
        (
            {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "/nonexistent"}},
            None,
            "/nonexistent",
        ),
        ({"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "false"}}, None, "returned 1"),
        ({"auth-provider": {"name": "oidc"}}, None, "auth-provider not supported"),
    ],
)
def test_a_kubeconfig_that_cannot_give_a_token_is_an_error(tmp_path, user, context, error):
    path = kubeconfig(tmp_path / "config", user)
    with pytest.raises(ValueError, match=error):
        operator_credential(None, path, context)
