"""Every bad flag of every ``mtc`` subcommand is one line on stderr that names the flag, the value and what
is expected, exit code 2, no traceback, and nothing created; ``--version``, ``--log-level`` and
``--log-format`` work in every position."""

import importlib.metadata
import json
import logging
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from replicator import cli
from replicator.backup_tier.object_store import BackupError
from replicator.cli import coordinator_command, logs, node_commands
from tests.helpers.kube.pki import CertificateAuthority

_NODE = ["node", "--node-id", "n1", "--csi-endpoint", "unix:///run/mtc/csi.sock", "--listen", "127.0.0.1:8470"]
_COORDINATOR = ["coordinator", "--listen", "127.0.0.1:8471", "--insecure"]
_STATUS = ["status", "--coordinator", "http://127.0.0.1:8471"]
_RESTORE = ["restore-from", "--coordinator", "http://127.0.0.1:8471", "--job", "ns/j", "--step", "7"]


@pytest.fixture
def files(tmp_path, monkeypatch) -> Path:
    """A working directory with one file of each kind the flags name, made before the listing is taken."""
    monkeypatch.chdir(tmp_path)
    ca = CertificateAuthority(tmp_path)
    ca.issue("server", "mtc-coordinator", ips=("127.0.0.1",))
    Path("token").write_text("s3cret\n")
    Path("empty").write_text(" \n")
    Path("notpem").write_text("hello\n")
    Path("dir").mkdir()
    csi = socket.socket(socket.AF_UNIX)  # a socket file, as a node agent's: bound, no process behind it
    csi.bind(str(tmp_path / "csi.sock"))
    yield tmp_path
    csi.close()


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# (argv, the line on stderr, or its start when it ends in "…"); relative paths are in the ``files`` directory.
CASES = [
    # node
    (
        [*_NODE, "--root", "r", "--listen", "nonsense"],
        "mtc node: --listen nonsense: not HOST:PORT (e.g. 0.0.0.0:8471, a port from 1 to 65535)",
    ),
    (
        [*_NODE, "--root", "r", "--listen", "127.0.0.1:65536"],
        "mtc node: --listen 127.0.0.1:65536: not HOST:PORT (e.g. 0.0.0.0:8471, a port from 1 to 65535)",
    ),
    (
        [*_NODE, "--root", "r", "--listen", "no-such-host.invalid:8470"],
        "mtc node: --listen no-such-host.invalid:8470: no such host (…",
    ),
    ([*_NODE, "--root", "notpem"], "mtc node: --root notpem: not a directory"),
    ([*_NODE, "--root", "r", "--node-id", ""], "mtc node: --node-id '': must not be empty"),
    (
        [*_NODE, "--root", "r", "--csi-endpoint", "/run/csi.sock"],
        "mtc node: --csi-endpoint /run/csi.sock: not unix:///ABSOLUTE/PATH (e.g. unix:///csi/csi.sock)",
    ),
    (
        [*_NODE, "--root", "r", "--coordinator", "mtc-coordinator:8471"],
        "mtc node: --coordinator mtc-coordinator:8471: not an http:// or https:// URL (e.g. https://mtc-coordinator.mtc-system:8471)",
    ),
    (
        [*_NODE, "--root", "r", "--backup", "gs:/bucket"],
        "mtc node: --backup gs:/bucket: not gs://BUCKET[/PREFIX], s3://BUCKET[/PREFIX] or file:///ABSOLUTE/PATH",
    ),
    (
        [*_NODE, "--root", "r", "--backup", "file://relative/path"],
        "mtc node: --backup file://relative/path: not gs://BUCKET[/PREFIX], s3://BUCKET[/PREFIX] or file:///ABSOLUTE/PATH",
    ),
    (
        [*_NODE, "--root", "r", "--backup", "gs://b", "--s3-endpoint-url", "http://127.0.0.1:9000"],
        "mtc node: --s3-endpoint-url http://127.0.0.1:9000: needs an s3:// --backup",
    ),
    (
        [*_NODE, "--root", "r", "--s3-endpoint-url", "127.0.0.1:9000"],
        "mtc node: --s3-endpoint-url 127.0.0.1:9000: not an http:// or https:// URL (e.g. https://mtc-coordinator.mtc-system:8471)",
    ),
    ([*_NODE, "--root", "r", "--topology", "zone"], "mtc node: --topology zone: not KEY=VALUE"),
    (
        [*_NODE, "--root", "r", "--default-size", "1Gb"],
        "mtc node: --default-size 1Gb: not a Kubernetes quantity (e.g. 512Mi, 2Gi, 1e9)",
    ),
    ([*_NODE, "--root", "r", "--default-size", "0"], "mtc node: --default-size 0: must be above zero"),
    (
        [*_NODE, "--root", "r", "--retention-seconds", "-1"],
        "mtc node: --retention-seconds -1: not a number of at least 0",
    ),
    ([*_NODE, "--root", "r", "--replicas", "3"], "mtc node: --replicas 3: not one of 1, 2"),
    ([*_NODE, "--root", "r", "--replicas", "two"], "mtc node: --replicas two: not a whole number of at least 1"),
    ([*_NODE, "--root", "r", "--backup-keep", "0"], "mtc node: --backup-keep 0: not a whole number of at least 1"),
    ([*_NODE, "--root", "r", "--max-nodes", "many"], "mtc node: --max-nodes many: not a whole number of at least 1"),
    ([*_NODE, "--root", "r", "--background-cpu", "nan"], "mtc node: --background-cpu nan: not a positive number"),
    (
        [*_NODE, "--root", "r", "--restore-deadline-seconds", "0"],
        "mtc node: --restore-deadline-seconds 0: not a positive number",
    ),
    (
        [*_NODE, "--root", "r", "--min-push-interval-seconds", "inf"],
        "mtc node: --min-push-interval-seconds inf: not a number of at least 0",
    ),
    ([*_NODE, "--root", "r", "--peer-token-file", "missing"], "mtc node: --peer-token-file missing: no such file"),
    (
        [*_NODE, "--root", "r", "--peer-token-file", "empty"],
        "mtc node: --peer-token-file empty: empty (expected the cluster token)",
    ),
    ([*_NODE, "--root", "r", "--peer-token-file", "dir"], "mtc node: --peer-token-file dir: not a regular file"),
    (
        [*_NODE, "--root", "r", "--peer-tls-ca", "notpem"],
        "mtc node: --peer-tls-ca notpem: not a PEM CA bundle (NO_CERTIFICATE_OR_CRL_FOUND)",
    ),
    (
        [*_NODE, "--root", "r", "--coordinator-ca", "missing.pem"],
        "mtc node: --coordinator-ca missing.pem: no such file",
    ),
    (
        [*_NODE, "--root", "r", "--peer-tls-cert", "missing.crt", "--peer-tls-key", "server.key"],
        "mtc node: --peer-tls-cert missing.crt: no such file",
    ),
    (
        [*_NODE, "--root", "r", "--peer-tls-cert", "server.crt"],
        "mtc node: --peer-tls-cert and --peer-tls-key go together",
    ),
    (
        [*_NODE, "--root", "r", "--peer-tls-cert", "server.crt", "--peer-tls-key", "ca.key"],
        "mtc node: --peer-tls-cert server.crt and --peer-tls-key ca.key: not a PEM certificate and its key (KEY_VALUES_MISMATCH)",
    ),
    (
        [*_NODE, "--root", "r", "--peer-tls-check", "host"],
        "mtc node: --peer-tls-check 'host': not one of 'name', 'ca'",
    ),
    (
        [*_NODE, "--root", "r", "--peer-tls-check", "ca"],
        "mtc node: --peer-tls-check ca needs --peer-tls-ca (the CA every peer's certificate is from)",
    ),
    (
        [*_NODE, "--root", "r", "--kubelet-registration-dir", "missing"],
        "mtc node: --kubelet-registration-dir missing: no such directory",
    ),
    (
        [*_NODE, "--root", "r", "--ramdisk-backend", "ram"],
        "mtc node: --ramdisk-backend 'ram': not one of 'tmpfs', 'dir'",
    ),
    (["node", "--root", "r"], "mtc node: the following arguments are required: --node-id, --csi-endpoint, --listen"),
    # publish, unpublish
    (
        ["publish", "--csi-endpoint", "unix:///nowhere/csi.sock", "--target", "t/mount", "--pod", "p"],
        "mtc publish: --csi-endpoint unix:///nowhere/csi.sock: no such socket",
    ),
    (
        ["publish", "--csi-endpoint", "csi.sock", "--target", "t/mount", "--pod", "p"],
        "mtc publish: --csi-endpoint csi.sock: not unix:///ABSOLUTE/PATH (e.g. unix:///csi/csi.sock)",
    ),
    (
        ["publish", "--csi-endpoint", "unix://{files}/csi.sock", "--target", "t/mount", "--pod", ""],
        "mtc publish: --pod '': must not be empty",
    ),
    (
        ["publish", "--csi-endpoint", "unix://{files}/csi.sock", "--target", "t/mount", "--pod", "p", "--attr", "=x"],
        "mtc publish: --attr =x: not KEY=VALUE",
    ),
    (
        ["unpublish", "--csi-endpoint", "unix://{files}/token", "--target", "t/mount"],
        "mtc unpublish: --csi-endpoint unix://{files}/token: not a socket",
    ),
    # gc
    (["gc", "--root", "missing/root", "--job", "ns/j"], "mtc gc: --root missing/root: no such directory"),
    (["gc", "--root", "notpem", "--idle"], "mtc gc: --root notpem: not a directory"),
    (["gc", "--root", "dir", "--job", "nojob"], "mtc gc: --job nojob: not NAMESPACE/JOB (e.g. default/llama)"),
    (["gc", "--root", "dir", "--job", "a/b/c"], "mtc gc: --job a/b/c: not NAMESPACE/JOB (e.g. default/llama)"),
    (["gc", "--root", "dir", "--job", "/j"], "mtc gc: --job /j: not NAMESPACE/JOB (e.g. default/llama)"),
    (["gc", "--root", "dir", "--job", "ns/"], "mtc gc: --job ns/: not NAMESPACE/JOB (e.g. default/llama)"),
    (["gc", "--root", "dir", "--job", "ns/j", "--idle"], "mtc gc: --idle not allowed with argument --job"),
    # coordinator
    (
        [*_COORDINATOR, "--listen", "nonsense"],
        "mtc coordinator: --listen nonsense: not HOST:PORT (e.g. 0.0.0.0:8471, a port from 1 to 65535)",
    ),
    (
        [*_COORDINATOR, "--listen", "0.0.0.0:http"],
        "mtc coordinator: --listen 0.0.0.0:http: not HOST:PORT (e.g. 0.0.0.0:8471, a port from 1 to 65535)",
    ),
    ([*_COORDINATOR, "--token-file", "missing"], "mtc coordinator: --token-file missing: no such file"),
    ([*_COORDINATOR, "--state-dir", "token"], "mtc coordinator: --state-dir token: not a directory"),
    (
        [*_COORDINATOR, "--node-timeout-seconds", "-5"],
        "mtc coordinator: --node-timeout-seconds -5: not a positive number",
    ),
    (
        [*_COORDINATOR, "--holder-grace-seconds", "soon"],
        "mtc coordinator: --holder-grace-seconds soon: not a positive number",
    ),
    ([*_COORDINATOR, "--max-nodes", "0"], "mtc coordinator: --max-nodes 0: not a whole number of at least 1"),
    (
        [*_COORDINATOR, "--tls-cert", "server.crt", "--tls-key", "missing.key"],
        "mtc coordinator: --tls-key missing.key: no such file",
    ),
    ([*_COORDINATOR, "--tls-key", "server.key"], "mtc coordinator: --tls-cert and --tls-key go together"),
    (
        [*_COORDINATOR, "--tls-cert", "notpem", "--tls-key", "server.key"],
        "mtc coordinator: --tls-cert notpem and --tls-key server.key: not a PEM certificate and its key",
    ),
    ([*_COORDINATOR, "--kube", "--kubeconfig", "missing"], "mtc coordinator: --kubeconfig missing: no such file"),
    ([*_COORDINATOR, "--kube-namespace", "ns"], "mtc coordinator: --kubeconfig and --kube-namespace need --kube"),
    (
        ["coordinator", "--listen", "127.0.0.1:8471"],
        "mtc coordinator: --token-file is required (the cluster token); pass --insecure to run without one on a one-machine experiment",
    ),
    # status, restore-from
    (
        [*_STATUS, "--coordinator", "not-a-url"],
        "mtc status: --coordinator not-a-url: not an http:// or https:// URL (e.g. https://mtc-coordinator.mtc-system:8471)",
    ),
    (
        [*_STATUS, "--coordinator", "ftp://c:21"],
        "mtc status: --coordinator ftp://c:21: not an http:// or https:// URL (e.g. https://mtc-coordinator.mtc-system:8471)",
    ),
    (
        [*_STATUS, "--coordinator", "http://c:99999"],
        "mtc status: --coordinator http://c:99999: not an http:// or https:// URL (e.g. https://mtc-coordinator.mtc-system:8471)",
    ),
    ([*_STATUS, "--job", "nope"], "mtc status: --job nope: not NAMESPACE/JOB (e.g. default/llama)"),
    ([*_STATUS, "--ca", "/x/ca.pem"], "mtc status: --ca /x/ca.pem: no such file"),
    ([*_STATUS, "--ca", "notpem"], "mtc status: --ca notpem: not a PEM CA bundle (NO_CERTIFICATE_OR_CRL_FOUND)"),
    ([*_RESTORE, "--step", "-1"], "mtc restore-from: --step -1: not a whole number of at least 0"),
    ([*_RESTORE, "--step", "12k"], "mtc restore-from: --step 12k: not a whole number of at least 0"),
    ([*_RESTORE, "--job", "j"], "mtc restore-from: --job j: not NAMESPACE/JOB (e.g. default/llama)"),
    ([*_RESTORE, "--token-file", "empty"], "mtc restore-from: --token-file empty: empty (expected the cluster token)"),
    ([*_RESTORE, "--ca", "dir"], "mtc restore-from: --ca dir: not a regular file"),
    (
        ["restore-from", "--coordinator", "http://c:8471"],
        "mtc restore-from: the following arguments are required: --job",
    ),
    ([*_RESTORE[:-2]], "mtc restore-from: give --step S to roll back, or --cancel to cancel a pending rollback"),
    # export
    (["export", "--to", "out"], "mtc export: one of the arguments --step-dir --backup is required"),
    (["export", "--step-dir", "nowhere", "--to", "out"], "mtc export: --step-dir nowhere: no such directory"),
    (
        ["export", "--step-dir", "dir", "--to", "out"],
        "mtc export: give the step's checksums with --manifest (one per node), or --unverified to export unchecked",
    ),
    (
        ["export", "--step-dir", "dir", "--unverified", "--to", "dir"],
        "mtc export: --to dir: exists; an export goes to a new directory",
    ),
    (
        ["export", "--step-dir", "dir", "--unverified", "--to", "out", "--format", "zip"],
        "mtc export: --format 'zip': not one of 'dcp', 'safetensors'",
    ),
    (
        ["export", "--backup", "ftp://b", "--to", "out"],
        "mtc export: --backup ftp://b: not gs://BUCKET[/PREFIX], s3://BUCKET[/PREFIX] or file:///ABSOLUTE/PATH",
    ),
    (
        ["export", "--backup", "file:///s", "--job", "j", "--to", "out"],
        "mtc export: --backup needs --namespace and --job",
    ),
    (
        ["export", "--backup", "file:///s", "--namespace", "NS", "--job", "j", "--to", "out"],
        "mtc export: --namespace NS: not a DNS-1123 label (lowercase letters, digits and '-')",
    ),
    (
        ["export", "--step-dir", "dir", "--step", "3", "--to", "out"],
        "mtc export: --namespace, --job and --step go with --backup",
    ),
    # the log flags, in either position; no command
    (
        ["--log-level", "verbose", *_STATUS],
        "mtc: --log-level verbose: not a log level (debug, info, warning, error, critical)",
    ),
    (
        [*_STATUS, "--log-level", "trace"],
        "mtc status: --log-level trace: not a log level (debug, info, warning, error, critical)",
    ),
    ([*_STATUS, "--log-format", "xml"], "mtc status: --log-format 'xml': not one of 'text', 'json'"),
    (
        ["frobnicate"],
        "mtc: COMMAND 'frobnicate': not one of 'node', 'publish', 'unpublish', 'gc', 'coordinator', 'status', 'restore-from', 'export', 'doctor'",
    ),
    ([], "mtc: the following arguments are required: COMMAND"),
]


@pytest.mark.parametrize(("argv", "line"), CASES, ids=[" ".join(argv)[:80] for argv, _ in CASES])
def test_a_bad_flag_is_one_line_naming_it_and_exit_2_and_nothing_is_created(files, monkeypatch, capsys, argv, line):
    monkeypatch.setattr(node_commands, "run_node", lambda config: pytest.fail("the node agent must not start"))
    monkeypatch.setattr(
        coordinator_command, "run_coordinator", lambda config: pytest.fail("the coordinator must not start")
    )
    before = _listing(files)
    assert cli.main([arg.format(files=files) for arg in argv]) == 2
    out, err = capsys.readouterr()
    expected = line.format(files=files)
    assert (out, err.count("\n")) == ("", 1) and err.startswith(expected.rstrip("…"))
    assert expected.endswith("…") or err == expected + "\n"
    assert _listing(files) == before


# The issue's cases, as an operator runs them: a process of its own, no traceback.
PROCESS_CASES = [
    (
        ["status", "--coordinator", "not-a-url"],
        2,
        "mtc status: --coordinator not-a-url: not an http:// or https:// URL",
    ),
    (["coordinator", "--listen", "nonsense", "--insecure"], 2, "mtc coordinator: --listen nonsense: not HOST:PORT"),
    (
        [
            "restore-from",
            "--coordinator",
            "http://127.0.0.1:1",
            "--job",
            "ns/j",
            "--step",
            "1",
            "--token-file",
            "missing-token",
        ],
        2,
        "mtc restore-from: --token-file missing-token: no such file",
    ),
    (
        ["--log-level", "debug", "status", "--coordinator", "http://127.0.0.1:1", "--ca", "/x/ca.pem"],
        2,
        "mtc status: --ca /x/ca.pem: no such file",
    ),
    (
        ["status", "--coordinator", "http://127.0.0.1:1", "--job", "nope"],
        2,
        "mtc status: --job nope: not NAMESPACE/JOB",
    ),
    (["gc", "--root", "gc-root/below", "--job", "ns/j"], 2, "mtc gc: --root gc-root/below: no such directory"),
    (  # the agent's venv has neither torch nor mtc-torch (mtc_torch is type-checked against .venv-torch's)
        ["export", "--step-dir", ".", "--unverified", "--to", "out"],
        1,
        "mtc export: needs torch and mtc-torch (pip install 'mtc-checkpointing[torch]'): No module named 'mtc_torch'",
    ),
    (
        ["publish", "--csi-endpoint", "unix:///nowhere/csi.sock", "--target", "target/mount", "--pod", "p"],
        2,
        "mtc publish: --csi-endpoint unix:///nowhere/csi.sock: no such socket",
    ),
]


@pytest.mark.parametrize(
    ("argv", "code", "start"), PROCESS_CASES, ids=[" ".join(argv)[:60] for argv, _, _ in PROCESS_CASES]
)
def test_the_issues_bad_inputs_end_in_one_line_without_a_traceback(tmp_path, argv, code, start):
    done = subprocess.run(
        [sys.executable, "-m", "replicator.cli", *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert (done.returncode, done.stdout) == (code, "")
    assert done.stderr.startswith(start) and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_failure_after_the_flags_is_one_line_and_logs_go_out_as_json_lines(tmp_path):
    with socket.socket() as taken:  # the coordinator's port, already bound: the process fails at start
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "replicator.cli",
                "--log-format",
                "json",
                "coordinator",
                "--listen",
                f"127.0.0.1:{port}",
                "--insecure",
                "--log-level",
                "WARNING",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    *logged, last = done.stderr.splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        last
        == f"mtc coordinator: [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): address already in use"
    )
    (warning,) = [json.loads(line) for line in logged]
    assert sorted(warning) == ["level", "logger", "message", "time"]
    assert (warning["level"], warning["logger"]) == ("WARNING", "replicator.coordinator.api.service")
    assert warning["message"].startswith(f"INSECURE: no --token-file; anyone who reaches 127.0.0.1:{port} can")
    assert warning["time"].endswith("+00:00")


def test_a_backup_store_without_credentials_is_one_line_naming_the_flag(files, monkeypatch, capsys):
    def no_credentials(config):
        raise BackupError("gs://bucket: no Application Default Credentials")

    monkeypatch.setattr(node_commands, "run_node", no_credentials)
    assert cli.main([*_NODE, "--root", "r", "--backup", "gs://bucket/p"]) == 1
    assert (
        capsys.readouterr().err == "mtc node: --backup gs://bucket/p: gs://bucket: no Application Default Credentials\n"
    )


def test_a_bug_is_logged_with_its_traceback_not_swallowed(files, monkeypatch, caplog):
    monkeypatch.setattr(node_commands, "run_node", lambda config: {}["missing"])
    assert cli.main([*_NODE, "--root", "r"]) == 1
    (record,) = [r for r in caplog.records if r.name == "replicator.cli"]
    assert record.getMessage() == "mtc node failed" and record.exc_info[0] is KeyError


def test_version_is_the_installed_distributions():
    done = subprocess.run(
        [sys.executable, "-m", "replicator.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        f"mtc {importlib.metadata.version('mtc-checkpointing')}\n",
        "",
    )


def test_version_from_a_source_tree_that_is_not_installed_is_pyprojects(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with open(Path(cli.__file__).parents[2] / "pyproject.toml", "rb") as f:
        assert cli.version() == tomllib.load(f)["project"]["version"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "debug", "--log-format", "json", "gc", "--root", ".", "--idle"],
        ["gc", "--root", ".", "--idle", "--log-level", "DEBUG", "--log-format", "json"],
        [
            "--log-level",
            "error",
            "--log-format",
            "text",
            "gc",
            "--root",
            ".",
            "--idle",
            "--log-level",
            "Debug",
            "--log-format",
            "json",
        ],
    ],
)
def test_log_flags_work_before_and_after_the_command_in_any_case(argv):
    args = cli.parser().parse_args(argv)
    assert (args.log_level, args.log_format, args.command) == (logging.DEBUG, "json", "gc")


def test_log_flags_default_to_info_text():
    args = cli.parser().parse_args(["gc", "--root", ".", "--idle"])
    assert (args.log_level, args.log_format) == (logging.INFO, "text")


def test_a_json_log_line_carries_the_exception_text():
    try:
        raise OSError("disk gone")
    except OSError:
        record = logging.LogRecord(
            "replicator.node.loop", logging.ERROR, __file__, 1, "pass %d failed", (3,), sys.exc_info()
        )
    line = json.loads(logs.JsonLines().format(record))
    assert (line["level"], line["logger"], line["message"]) == ("ERROR", "replicator.node.loop", "pass 3 failed")
    assert line["exception"].startswith("Traceback (most recent call last):") and line["exception"].endswith(
        "OSError: disk gone"
    )
    assert "\n" not in logs.JsonLines().format(record)
