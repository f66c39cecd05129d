"""The gRPC stubs in ``protos/`` are committed, so that a wheel, an sdist or ``pip install git+URL`` builds with
setuptools alone (no grpcio-tools in the build, nothing to fetch offline). They must be what the pinned
grpcio-tools (pyproject.toml, ``dev``) generates from the vendored ``.proto`` files: regenerate with
``make stubs`` after a change to either."""

import filecmp
from importlib import resources
from pathlib import Path

import pytest
from grpc_tools import protoc

REPO = Path(__file__).resolve().parents[2]
PROTOS = sorted(p.relative_to(REPO) for p in (REPO / "protos").glob("*.proto"))
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def test_each_proto_has_its_committed_stubs():
    assert [p.name for p in PROTOS] == ["csi.proto", "pluginregistration.proto"]
    for proto in PROTOS:
        for suffix in SUFFIXES:
            assert (REPO / proto.parent / (proto.stem + suffix)).is_file(), f"{proto.stem}{suffix}: run make stubs"


@pytest.mark.parametrize("proto", PROTOS, ids=str)
def test_committed_stubs_are_what_the_pinned_grpcio_tools_generates(proto, tmp_path, monkeypatch):
    # protoc names the output after the path relative to -I: run from the repo root, as `make stubs` does.
    monkeypatch.chdir(REPO)
    include = resources.files("grpc_tools") / "_proto"
    argv = ["protoc", "-I.", f"-I{include}", *(f"--{kind}_out={tmp_path}" for kind in ("python", "pyi", "grpc_python"))]
    assert protoc.main([*argv, str(proto)]) == 0
    for suffix in SUFFIXES:
        name = proto.parent / (proto.stem + suffix)
        assert filecmp.cmp(tmp_path / name, REPO / name, shallow=False), f"{name} is stale: run make stubs"
