"""The kubelet's plugin registration (``csi_driver/registration.py``), spoken to over its socket as the kubelet's
plugin watcher does: ``GetInfo``, then ``NotifyRegistrationStatus``."""

import logging
import os
import socket
import tempfile

import grpc
import pytest

from csi_driver.registration import RegistrationServer, RegistrationServicer, registration_socket
from protos import pluginregistration_pb2, pluginregistration_pb2_grpc

DRIVER = "ramdisk.csi.mtc.dev"


@pytest.fixture
def registration(tmp_path):
    server = RegistrationServer(str(tmp_path / "registry"), RegistrationServicer(DRIVER, "unix:///run/mtc/csi.sock"))
    server.start()
    yield server
    server.stop(grace=0)


def kubelet_stub(server: RegistrationServer) -> tuple[grpc.Channel, pluginregistration_pb2_grpc.RegistrationStub]:
    channel = grpc.insecure_channel("unix://" + server.path)
    return channel, pluginregistration_pb2_grpc.RegistrationStub(channel)


def test_get_info_names_a_csi_plugin_its_socket_path_and_csi_1_0(registration, tmp_path):
    assert registration.path == str(tmp_path / "registry" / f"{DRIVER}-reg.sock")
    channel, stub = kubelet_stub(registration)
    with channel:
        info = stub.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=5)
    assert (info.type, info.name, info.endpoint) == (
        "CSIPlugin",
        DRIVER,
        "/run/mtc/csi.sock",
    )  # a path: kubelet dials it as is
    assert list(info.supported_versions) == ["1.0.0"]


def test_refused_registration_is_logged_with_the_kubelets_reason_and_cleared_by_a_success(registration, caplog):
    channel, stub = kubelet_stub(registration)
    with channel, caplog.at_level(logging.INFO, logger="csi_driver.registration"):
        stub.NotifyRegistrationStatus(
            pluginregistration_pb2.RegistrationStatus(
                plugin_registered=False,
                error="RegisterPlugin error -- no handler registered for plugin type: CSIPlugin",
            ),
            timeout=5,
        )
        servicer = registration.servicer
        assert not servicer.registered.is_set()
        assert servicer.error == "RegisterPlugin error -- no handler registered for plugin type: CSIPlugin"
        [refusal] = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert DRIVER in refusal.getMessage() and "no handler registered" in refusal.getMessage()

        stub.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
        assert servicer.registered.is_set() and servicer.error is None


def test_a_refusal_without_reason_still_says_so():
    servicer = RegistrationServicer(DRIVER, "unix:///c.sock")
    servicer.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=False), None)
    assert servicer.error == "no reason given" and not servicer.registered.is_set()


def test_stale_socket_of_a_killed_agent_is_replaced_and_stop_removes_the_socket(tmp_path):
    directory = tmp_path / "registry"
    directory.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(registration_socket(str(directory), DRIVER))  # bound, never listening: what a SIGKILL leaves
    stale.close()
    server = RegistrationServer(str(directory), RegistrationServicer(DRIVER, "unix:///c.sock")).start()
    try:
        channel, stub = kubelet_stub(server)
        with channel:
            assert stub.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=5).name == DRIVER
    finally:
        server.stop(grace=0)
    assert not os.path.exists(server.path)  # the kubelet unregisters the driver when its socket goes


def test_endpoint_that_is_not_a_unix_socket_is_refused():
    with pytest.raises(ValueError, match="unix:///path"):
        RegistrationServicer(DRIVER, "tcp://127.0.0.1:10000")


def test_sigterm_removes_the_agents_csi_and_registration_sockets(start_agent):
    # The pod's end (helm uninstall, a rollout): nothing may be left for the kubelet to find on the node.
    with tempfile.TemporaryDirectory(prefix="mtc-reg-") as registry:  # short: a socket path has 107 bytes at most
        agent = start_agent(backend="dir", extra_args=["--kubelet-registration-dir", registry])
        csi_socket = agent.endpoint[len("unix://") :]
        assert os.listdir(registry) == [f"{DRIVER}-reg.sock"] and os.path.exists(csi_socket)
        agent.stop()  # SIGTERM
        assert agent.process.returncode == 0, agent.tail_log()
        assert os.listdir(registry) == []
        assert not os.path.exists(csi_socket)
