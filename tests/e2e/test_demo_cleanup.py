"""``make demo`` leaves the machine as it found it: no mount and no file of its own remains,
whether it is interrupted with Ctrl-C or fails.

The real demo (``python -m examples.demo``) runs in its own mount and network namespaces, so its
mount table can be compared exactly (before and after, read inside the namespace) while other
tests mount and unmount on the host, and its fixed ports cannot collide with another run.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from examples.local_cluster import unmount_all_below
from tests.helpers import REPO
from tests.helpers.tools import requires_root

# Runs in the namespaces: records the mount table, runs the demo, records it again. The demo's
# Ctrl-C is not its own (a Python handler, unlike SIG_IGN, is not inherited through exec).
_WRAPPER = """
import json, signal, subprocess, sys
signal.signal(signal.SIGINT, lambda *_: None)
read = lambda: open("/proc/self/mountinfo").read().splitlines()
before = read()
code = subprocess.call([sys.executable, "-m", "examples.demo"])
print(json.dumps({"code": code, "before": before, "after": read()}))
"""


@pytest.fixture
def scratch():
    """The demo's TMPDIR: short, because the agents' CSI sockets live below it (unix socket paths
    are limited to 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="mtc-dc-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _start_demo(tmp_path: Path, scratch: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [
        "unshare",
        "--mount",
        "--net",
        "--propagation",
        "private",
        "sh",
        "-c",
        'ip link set lo up && exec "$0" -c "$1"',
        sys.executable,
        _WRAPPER,
    ]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "demo.log", "wb"),
        env={**os.environ, "TMPDIR": str(scratch), **(env or {})},
        start_new_session=True,
    )
    return process


def _mounts_below(pid: int, directory: Path) -> list[str]:
    """Mount points below ``directory`` in the mount namespace of process ``pid``."""
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p.startswith(str(directory) + os.sep)]


def _finish(process: subprocess.Popen, tmp_path: Path) -> dict:
    try:
        out, _ = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, (tmp_path / "demo.log").read_text()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])


def _assert_left_nothing(result: dict, scratch: Path, log: Path) -> None:
    before, after = set(result["before"]), set(result["after"])
    assert not after - before, "mounts left behind:\n" + "\n".join(sorted(after - before))
    # The table may only have lost what others removed meanwhile: deleting a mount point on the
    # host detaches the copy in this namespace (Linux >= 3.18). Anything else the demo unmounted.
    lost = [line for line in before - after if os.path.exists(line.split()[4])]
    assert not lost, "mounts the demo should not have touched are gone:\n" + "\n".join(lost)
    assert list(scratch.iterdir()) == [], f"files left behind; demo log:\n{log.read_text()[-3000:]}"


@requires_root
def test_demo_interrupted_with_ctrl_c_twice_unmounts_and_removes_everything(tmp_path, scratch):
    process = _start_demo(tmp_path, scratch)
    # Interrupt once the pods are published: 4 job ramdisks and 4 pod bind mounts.
    deadline = time.monotonic() + 120
    while len(_mounts_below(process.pid, scratch)) < 8:
        assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "demo.log").read_text()[-3000:]
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)  # an impatient second Ctrl-C while it tears down
    result = _finish(process, tmp_path)
    assert result["code"] != 0
    assert "KeyboardInterrupt" in (tmp_path / "demo.log").read_text()
    _assert_left_nothing(result, scratch, tmp_path / "demo.log")


@requires_root
def test_demo_whose_training_fails_unmounts_and_removes_everything(tmp_path, scratch):
    # Every training process exits at start-up (a sitecustomize on PYTHONPATH), after the pods
    # were published: the demo fails with its error and still tears everything down.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\nif sys.argv and sys.argv[0].endswith('train.py'):\n    sys.exit(3)\n"
    )
    process = _start_demo(tmp_path, scratch, {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    result = _finish(process, tmp_path)
    assert result["code"] == 1
    assert "training process demo-slice-" in (tmp_path / "demo.log").read_text()
    _assert_left_nothing(result, scratch, tmp_path / "demo.log")


@requires_root
def test_unmount_all_below_leaves_other_mounts_alone(tmp_path):
    inside, beside = tmp_path / "a" / "m", tmp_path / "ab"
    for point in (inside, beside):
        point.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "mtc-test", str(point)], check=True)
    try:
        unmount_all_below(str(tmp_path / "a"))
        assert not os.path.ismount(inside)
        assert os.path.ismount(beside)  # a sibling whose name starts the same is not below
    finally:
        subprocess.run(["umount", "-l", str(beside)], check=False)
