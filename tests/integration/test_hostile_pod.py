"""A hostile training pod against real node agents on real tmpfs: every attack of the untrusted-pod threat model.

The pod owns its client directory. It plants symlinks, FIFOs and odd names there and asks for absurd
volumes. After each attack: the host files are byte-identical, the secret's bytes are in no regular
file the pod, a peer or the bucket can read, the agent still publishes a new job and reports its new
steps, and the job was told what was wrong.
"""

import concurrent.futures
import itertools
import json
import os
import re
import secrets
import stat
import threading
import time
import urllib.request

import grpc
import pytest

from csi_driver import kubelet
from examples.local_cluster import LocalCluster, unmount_all_below
from replicator.local_tier.frameworks.client_dir import MAX_REPLICATOR_YAML_BYTES
from replicator.local_tier.frameworks.orbax import ERRORS_FILE, FAILED_FILE, JAX_INIT_INFO_FILE, REPLICATOR_FILE
from replicator.local_tier.frameworks.pytorch import PRERESTORE_FILE
from tests.helpers.agents import rank_of, replicator_yaml, scrape
from tests.helpers.hostile_yaml import alias_bomb, nested_flow_lists, nested_mappings
from tests.helpers.polling import wait_until
from tests.helpers.ports import listen_address
from tests.helpers.steps import commit_step
from tests.helpers.tools import requires_root

pytestmark = requires_root

SECRET = b"HOST-SECRET-" + secrets.token_hex(16).encode()
_jobs = itertools.count()


@pytest.fixture(scope="module", params=["token", "peer grants"])
def world(request, tmp_path_factory):
    """Two node agents (peer tier, file:// backups) and a coordinator, on the cluster token alone or with peer
    grants (``--peer-grants``, issue 40); a host directory with a secret and a file the agent must never write."""
    base = tmp_path_factory.mktemp("hostile")
    host = base / "host"
    (host / "secret-dir").mkdir(parents=True)
    (host / "secret.txt").write_bytes(SECRET)
    (host / "secret-dir" / "data").write_bytes(SECRET)
    (host / "settings.yaml").write_text(f"job-name: {SECRET.decode()}\nframework: orbax\n")
    (host / "victim.txt").write_bytes(b"host file the agent must never write\n")
    bucket = base / "bucket"
    bucket.mkdir()
    cluster = LocalCluster(
        str(base / "cluster"), listen_address, backup=f"file://{bucket}", peer_grants=request.param == "peer grants"
    ).start(2)
    world = {"host": host, "bucket": bucket, "cluster": cluster, "pods": base / "pods"}
    world["host_files"] = _snapshot(host)
    yield world
    cluster.stop()
    unmount_all_below(str(base))


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _snapshot(directory):
    return {
        p: _read(os.path.join(directory, p)) for p in ("secret.txt", "secret-dir/data", "settings.yaml", "victim.txt")
    }


def publish_job(world, name, nodes=2, framework="orbax"):
    """Publishes one pod of job ``name`` on each agent; returns their client dirs (the pod's view)."""
    targets = []
    for i, agent in enumerate(world["cluster"].agents[:nodes]):
        target = world["pods"] / f"{name}-{i}" / "mount"
        kubelet.publish(
            agent.endpoint,
            str(target),
            f"{name}-slice-0-{i}-a",
            attributes={"nodes": str(nodes), "size": "16Mi", "framework": framework},
        )
        targets.append(target)
    return targets


def held(world, job) -> dict[int, set[int]]:
    """rank -> steps the coordinator believes are held for the job (pods ``<job>-slice-0-<i>-a``)."""
    jobs = world["cluster"].coordinator.status(f"{job}-slice")["jobs"]
    return {int(rank): {int(s) for s in steps} for rank, steps in (jobs[0]["held"] if jobs else {}).items()}


def assert_aftermath(world):
    """What must hold after every attack."""
    cluster = world["cluster"]
    assert _snapshot(world["host"]) == world["host_files"], "a host file changed"
    for agent in cluster.agents:
        assert agent.process.poll() is None, f"{agent.node_id} died: {agent.tail_log()}"
        assert isinstance(json.loads(_read(os.path.join(agent.root, "state.json"))), dict), "state.json was overwritten"
    leaks = [
        path
        for top in (cluster.workdir, world["bucket"], world["pods"])
        for path in _regular_files(top)
        if SECRET in _read(path)
    ]
    assert leaks == [], f"the secret is readable at {leaks}"
    # Another tenant publishes, trains and is reported on the same agents.
    job = f"good{next(_jobs)}"
    targets = publish_job(world, job)
    wait_until(lambda: all((t / JAX_INIT_INFO_FILE).exists() for t in targets), 20, "ranks assigned")
    for target in targets:
        (target / REPLICATOR_FILE).write_text(replicator_yaml(job, rank_of(target), 2, backup_interval_steps=1))
    # As Orbax does: train only once the restore marker (here: start fresh) is there.
    wait_until(lambda: all(any(n.endswith(".restore") for n in os.listdir(t)) for t in targets), 20, "restore markers")
    for target in targets:
        commit_step(target, 1, {"_CHECKPOINT_METADATA": b"{}", "state/data": os.urandom(4096)})
    wait_until(
        lambda: held(world, job) == {0: {1}, 1: {1}}, 20, lambda: f"step 1 held by both ranks: {held(world, job)}"
    )


def _regular_files(top):
    for parent, _, names in os.walk(top):  # never follows a symlink into a directory
        for name in names:
            path = os.path.join(parent, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                yield path


@pytest.fixture
def evil(world):
    """The hostile job's two pods, ranks assigned; returns their client dirs."""
    job = f"evil{next(_jobs)}"
    targets = publish_job(world, job)
    wait_until(lambda: all((t / JAX_INIT_INFO_FILE).exists() for t in targets), 20, "ranks assigned")
    return job, targets


def test_failed_file_symlinked_to_a_host_file_is_replaced_not_read(world, evil):
    _, (pod, _) = evil
    os.symlink(world["host"] / "secret.txt", pod / FAILED_FILE)
    (pod / REPLICATOR_FILE).write_text("not: [valid")
    wait_until(
        lambda: not (pod / FAILED_FILE).is_symlink() and (pod / FAILED_FILE).exists(), 20, "replicator.failed replaced"
    )
    assert b"not valid YAML" in (pod / FAILED_FILE).read_bytes() and SECRET not in (pod / FAILED_FILE).read_bytes()
    assert_aftermath(world)


def test_replicator_yaml_symlinked_to_a_host_file_is_refused_without_reading_it(world, evil):
    _, (_, pod) = evil
    os.symlink(world["host"] / "settings.yaml", pod / REPLICATOR_FILE)
    wait_until(lambda: (pod / FAILED_FILE).exists(), 20, "replicator.failed written")
    failed = (pod / FAILED_FILE).read_bytes()
    assert b"replicator.yaml is unusable" in failed and b"symlink" in failed and SECRET not in failed
    assert not os.path.lexists(pod / REPLICATOR_FILE)  # consumed, so Orbax reads replicator.failed
    assert_aftermath(world)


def test_protocol_temp_names_symlinked_to_host_files_are_never_written_through(world):
    job = f"evil{next(_jobs)}"
    cluster = world["cluster"]
    target = world["pods"] / f"{job}-0" / "mount"
    kubelet.publish(
        cluster.agents[0].endpoint, str(target), f"{job}-slice-0-0-a", attributes={"nodes": "2", "size": "16Mi"}
    )
    state = os.path.join(cluster.agents[0].root, "state.json")
    for name, victim in [
        (JAX_INIT_INFO_FILE + ".mtc-tmp", world["host"] / "victim.txt"),
        (JAX_INIT_INFO_FILE, state),
        (ERRORS_FILE + ".mtc-tmp", state),
    ]:
        os.symlink(victim, target / name)
    other = world["pods"] / f"{job}-1" / "mount"
    kubelet.publish(
        cluster.agents[1].endpoint, str(other), f"{job}-slice-0-1-a", attributes={"nodes": "2", "size": "16Mi"}
    )
    wait_until(
        lambda: (target / JAX_INIT_INFO_FILE).exists() and not (target / JAX_INIT_INFO_FILE).is_symlink(),
        20,
        "jax-init-info.txt written in place",
    )
    assert rank_of(target) in (0, 1)
    assert_aftermath(world)


def test_steps_that_are_or_hold_symlinks_or_fifos_are_refused_and_reported(world, evil):
    job, (pod, peer_pod) = evil
    os.symlink(world["host"] / "secret.txt", pod / ERRORS_FILE)  # the error report must not read it
    os.symlink(world["host"] / "secret-dir", pod / "5")  # a step that is a symlink to a host directory
    commit_step(pod, 6, {"_CHECKPOINT_METADATA": b"{}"})
    os.symlink(world["host"] / "secret.txt", pod / "6" / "stolen")  # a step holding a symlinked file
    commit_step(pod, 7, {"_CHECKPOINT_METADATA": b"{}"})
    os.mkfifo(pod / "7" / "fifo")  # a FIFO: opening it would block the agent
    other_tenant = world["cluster"].agents[0].root
    os.symlink(other_tenant, pod / "9")  # another tenant's ramdisks
    commit_step(pod, 8, {"_CHECKPOINT_METADATA": b"{}", "state/data": b"fine"})  # a proper step still counts
    wait_until(
        lambda: (
            (pod / ERRORS_FILE).exists() and all(f"step {s} " in (pod / ERRORS_FILE).read_text() for s in (5, 6, 7, 9))
        ),
        20,
        "steps 5, 6, 7 and 9 reported refused",
    )
    errors = (pod / ERRORS_FILE).read_bytes()
    assert not (pod / ERRORS_FILE).is_symlink() and SECRET not in errors
    assert b"not replicated or backed up" in errors and b"fifo is a FIFO" in errors and b"stolen is a symlink" in errors
    wait_until(lambda: 8 in held(world, job).get(rank_of(pod), set()), 20, "step 8 held")
    assert set().union(*held(world, job).values()).isdisjoint({5, 6, 7, 9})
    refused = re.search(r"^mtc_refused_steps_total (\S+)$", scrape(world["cluster"].agents[0].url), re.MULTILINE)
    assert refused and float(refused[1]) >= 4
    # The pod removes its links: nothing of them comes back into it from any tier.
    for name in ("5", "9"):
        os.unlink(pod / name)
    assert_aftermath(world)


def test_a_pytorch_pods_planted_prerestore_adopted_names_and_partial_steps_are_replaced_or_refused(world):
    job = f"evil{next(_jobs)}"
    pod, peer_pod = publish_job(world, job, framework="pytorch.distributed")
    os.symlink(world["host"] / "victim.txt", pod / PRERESTORE_FILE)  # the agent's write must replace it
    for rank, target in enumerate((pod, peer_pod)):  # ranks are the pods' JobSet indexes
        (target / REPLICATOR_FILE).write_text(
            f"job-name: {job}\nframework: pytorch.distributed\nnode-rank: {rank}\nnodes: 2\n"
            f"peers-per-node: 1\nbackup-interval-minutes: 30\n"
        )
    wait_until(
        lambda: all(any(n.endswith(".restore") for n in os.listdir(t)) for t in (pod, peer_pod)), 20, "restore markers"
    )
    assert (pod / PRERESTORE_FILE).read_text() == "{}\n" and not (pod / PRERESTORE_FILE).is_symlink()
    os.symlink(world["host"] / "secret-dir", pod / "step=5")  # an adopted marker's name, pointing at the host
    commit_step(
        pod, 6, {"rank-0-of-2/.metadata": b"m", "rank-1-of-2/__0_0.distcp": b"half a node"}
    )  # local rank 1 unfinished
    commit_step(pod, 7, {"rank-0-of-1/.metadata": b"m", "rank-0-of-1/__0_0.distcp": b"fine"})
    wait_until(
        lambda: (pod / ERRORS_FILE).exists() and all(f"step {s} " in (pod / ERRORS_FILE).read_text() for s in (5, 6)),
        20,
        "steps 5 and 6 refused",
    )
    assert "lacks DCP's .metadata of local rank(s) [1] of 2" in (pod / ERRORS_FILE).read_text()
    wait_until(lambda: 7 in held(world, job).get(0, set()), 20, "step 7 held")
    assert set().union(*held(world, job).values()).isdisjoint({5, 6})
    os.unlink(pod / "step=5")
    assert_aftermath(world)


def _hostile_configs() -> dict[str, str]:
    """What-it-is -> a ``replicator.yaml`` of a one-node job built to stall the agent's parse."""
    config = replicator_yaml("evil", 0, 1, backup_interval_steps=1)
    hostile = {f"alias bomb of {levels} levels": alias_bomb(config, levels) for levels in range(6, 13)}
    hostile["64 KiB of nested flow lists"] = nested_flow_lists(config)
    hostile["64 KiB of nested mappings"] = nested_mappings(config)
    assert all(len(text.encode()) <= MAX_REPLICATOR_YAML_BYTES for text in hostile.values())
    return hostile


def _write_replacing(path, text: str) -> float:
    """Writes ``path`` as Orbax does (a whole file renamed into place); returns its mtime (the kernel's clock)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    written = tmp.stat().st_mtime
    os.replace(tmp, path)
    return written


def _scrape_until(url: str, stop: threading.Event) -> list[float]:
    """Seconds each ``/metrics`` request to ``url`` took, one every 50 ms until ``stop``."""
    took = []
    while not stop.is_set():
        started = time.monotonic()
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            response.read()
        took.append(time.monotonic() - started)
        stop.wait(0.05)
    return took


def test_alias_bombs_and_deep_nesting_are_refused_at_once_while_the_agent_serves_others(world):
    """Issue 48: alias bombs of 6 to 12 levels and 64 KiB documents nested as deep as they can, each
    the ``replicator.yaml`` of a pod on one agent, all at once. Each is refused within 1 s through
    ``replicator.failed``, naming the anchor or the nesting; meanwhile the agent answers ``/metrics``
    and publishes another pod's volume (a real NodePublishVolume over gRPC), each within 1 s."""
    agent = world["cluster"].agents[0]
    pods = {}
    for what, text in _hostile_configs().items():
        (pod,) = publish_job(world, f"evil{next(_jobs)}", nodes=1)
        pods[what] = (pod, text)
    wait_until(lambda: all((pod / JAX_INIT_INFO_FILE).exists() for pod, _ in pods.values()), 20, "ranks assigned")
    rejected_before = _rejected(agent)
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        scrapes = pool.submit(_scrape_until, agent.url, stop)
        written = {what: _write_replacing(pod / REPLICATOR_FILE, text) for what, (pod, text) in pods.items()}
        time.sleep(0.3)  # the agent's next pass (every 0.2 s) reads the files
        started = time.monotonic()
        kubelet.publish(
            agent.endpoint,
            str(world["pods"] / "bystander" / "mount"),
            f"bystander{next(_jobs)}-slice-0-0-a",
            attributes={"nodes": "1", "size": "16Mi"},
            timeout=10,
        )
        published = time.monotonic() - started
        try:
            wait_until(
                lambda: all((pod / FAILED_FILE).exists() for pod, _ in pods.values()),
                10,
                lambda: (
                    f"replicator.failed of {[w for w, (pod, _) in pods.items() if not (pod / FAILED_FILE).exists()]}"
                ),
            )
        finally:
            stop.set()
        took = scrapes.result()
    assert published < 1.0, f"another pod's publish took {published:.2f} s"
    assert took and max(took) < 1.0, f"/metrics took up to {max(took):.2f} s"
    for what, (pod, _) in pods.items():
        refused = (pod / FAILED_FILE).stat().st_mtime - written[what]
        failed = (pod / FAILED_FILE).read_text()
        assert refused < 1.0, f"{what}: refused after {refused:.2f} s"
        reason = "anchors and aliases are refused" if what.startswith("alias") else "nesting deeper than 8 levels"
        assert failed.startswith("replicator.yaml field (document): ") and reason in failed, f"{what}: {failed}"
        assert "refused at once" in failed and len(failed) < 512, f"{what}: {failed}"
        assert not (pod / REPLICATOR_FILE).exists(), f"{what}: not consumed"
    assert _rejected(agent) - rejected_before == len(pods)
    assert_aftermath(world)


def _rejected(agent) -> float:
    found = re.search(r'^mtc_replicator_yaml_total\{result="rejected"\} (\S+)$', scrape(agent.url), re.MULTILINE)
    return float(found[1]) if found else 0.0


def test_non_ascii_digit_names_neither_crash_nor_alias_steps(world, evil):
    job, (pod, _) = evil
    (pod / ".mtc-staged-\u00b2").mkdir()  # '²'.isdigit() is True, int('²') raises
    commit_step(pod, "\u0663", {"data": b"x"})  # an Arabic-Indic 3: must not alias step 3
    commit_step(pod, 4, {"_CHECKPOINT_METADATA": b"{}"})
    wait_until(lambda: 4 in held(world, job).get(rank_of(pod), set()), 20, "step 4 held")
    assert set().union(*held(world, job).values()) == {4}
    assert_aftermath(world)


@pytest.mark.parametrize(
    ("attributes", "named"),
    [
        ({"nodes": "1000000000"}, "nodes"),
        ({"nodes": "4", "slices": "8"}, "slices"),
        ({"nodes": "2", "size": "1e99999999"}, "size"),
        ({"nodes": "2", "size": "1e999999"}, "size"),
        ({"nodes": "2", "size": "64Ti"}, "size"),
    ],
)
def test_unbounded_volume_attributes_are_invalid_argument_at_once(world, attributes, named):
    agent = world["cluster"].agents[0]
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        kubelet.publish(
            agent.endpoint,
            str(world["pods"] / "absurd" / "mount"),
            f"absurd{next(_jobs)}-slice-0-0-a",
            attributes=attributes,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in err.value.details()
    assert time.monotonic() - started < 2.0
    assert_aftermath(world)
