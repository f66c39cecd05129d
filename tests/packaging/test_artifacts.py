"""``make release``'s artifacts, each used from ``dist/`` as a user would (``make release-check``): the agent's wheel
in a clean venv with its dependencies, its sdist, the chart's ``.tgz`` and the image archive's labels and tag."""

import json
import re
import tarfile
import tomllib
import zipfile

import pytest

from tests.helpers import REPO
from tests.helpers.chart import docs, run, template_argv
from tests.helpers.clean_venv import CleanVenv, artifact

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
STUBS = [f"protos/{p}{s}" for p in ("csi", "pluginregistration") for s in ("_pb2.py", "_pb2_grpc.py")]


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> CleanVenv:
    """A clean venv with the agent's wheel and its dependencies from PyPI (about a minute)."""
    venv = CleanVenv(tmp_path_factory.mktemp("agent") / "venv")
    venv.pip_install(str(artifact(f"mtc_checkpointing-{VERSION}-py3-none-any.whl")))
    return venv


def test_the_wheel_and_the_sdist_hold_the_generated_stubs_and_not_the_client():
    wheel = zipfile.ZipFile(artifact(f"mtc_checkpointing-{VERSION}-py3-none-any.whl")).namelist()
    sdist = tarfile.open(artifact(f"mtc_checkpointing-{VERSION}.tar.gz")).getnames()
    assert set(STUBS) <= set(wheel)
    assert {f"mtc_checkpointing-{VERSION}/{s}" for s in STUBS} <= set(sdist)
    assert not [n for n in wheel if n.startswith("mtc_torch/")]
    client = zipfile.ZipFile(artifact(f"mtc_torch-{VERSION}-py3-none-any.whl")).namelist()
    assert "mtc_torch/manager.py" in client and not [n for n in client if n.split("/")[0] in ("replicator", "protos")]


def test_mtc_version_and_the_commands_help_run_from_the_wheel_in_a_clean_venv(agent):
    done = agent.run(agent.bin("mtc"), "--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"mtc {VERSION}"), done.stderr
    for command in ("node", "coordinator"):
        done = agent.run(agent.bin("mtc"), command, "--help")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: mtc {command}"), done.stdout[:200]


def test_the_cli_imports_the_installed_packages_with_their_stubs(agent):
    code = "import protos.csi_pb2_grpc, replicator.cli; print(protos.csi_pb2_grpc.__file__, replicator.cli.__file__)"
    done = agent.run(agent.bin("python"), "-c", code)
    assert done.returncode == 0, done.stderr
    site = str(agent.site_packages())
    assert all(path.startswith(site) for path in done.stdout.split()), done.stdout


def test_the_chart_archive_renders_what_the_charts_directory_renders():
    archive = artifact(f"mtc-{VERSION}.tgz")
    chart = yaml_of(tarfile.open(archive).extractfile("mtc/Chart.yaml").read())
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)
    from_dir = template_argv()
    from_archive = [str(archive) if a == str(REPO / "charts" / "mtc") else a for a in from_dir]
    assert from_archive != from_dir
    rendered = [generated_values_masked(d) for d in docs(run(from_archive))]
    assert rendered == [generated_values_masked(d) for d in docs(run(from_dir))] and len(rendered) > 10


def generated_values_masked(obj: dict) -> dict:
    """``obj`` with the values the chart generates at each render (the cluster token, the CAs and certificates:
    charts/mtc/templates/secrets.yaml) replaced by their keys' names."""
    if obj.get("kind") == "Secret":
        obj = {**obj, "data": {key: key for key in obj.get("data", {})}}
    return obj


def yaml_of(text: bytes) -> dict:
    return docs(text.decode())[0]


def image_config(archive: tarfile.TarFile) -> tuple[list[str], dict]:
    """The image's tags and its config (labels under ``config.Labels``): an OCI archive (buildah push) or
    docker save's (``manifest.json``)."""

    def read(name: str) -> dict:
        return json.load(archive.extractfile(name))

    names = archive.getnames()
    if "index.json" in names:
        entry = read("index.json")["manifests"][0]
        manifest = read("blobs/" + entry["digest"].replace(":", "/"))
        tags = [entry.get("annotations", {}).get("org.opencontainers.image.ref.name", "")]
        return tags, read("blobs/" + manifest["config"]["digest"].replace(":", "/"))
    entry = read("manifest.json")[0]
    return entry["RepoTags"], read(entry["Config"])


def test_the_image_archive_is_tagged_and_labelled_with_the_package_version_and_commit():
    with tarfile.open(artifact(f"mtc-agent-{VERSION}.tar")) as archive:
        tags, config = image_config(archive)
    assert [t.rsplit(":", 1)[1] for t in tags] == [VERSION], tags
    labels = {k.removeprefix("org.opencontainers.image."): v for k, v in config["config"]["Labels"].items()}
    home = yaml_of((REPO / "charts" / "mtc" / "Chart.yaml").read_bytes())["home"]
    assert {k: labels.get(k) for k in ("title", "version", "source", "licenses")} == {
        "title": "mtc-agent",
        "version": VERSION,
        "source": home,
        "licenses": "Apache-2.0",
    }
    assert re.fullmatch("[0-9a-f]{40}", labels["revision"]), labels
    assert config["config"]["Entrypoint"] == ["mtc"]
