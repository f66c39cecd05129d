"""The CPU-only shim MaxText runs with (examples/maxtext/sitecustomize.py -> examples/cpu_cluster.py),
and the MaxText JobSet whose flags ``make e2e-maxtext`` runs.

The shim is checked in fresh interpreters, started the way the e2e starts MaxText (this directory on
``PYTHONPATH``), because it acts at interpreter start-up and patches JAX process-wide.
"""

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.drivers.e2e_maxtext import MTC_FLAGS, TRAINER, jobset_flags
from tests.helpers import REPO

SHIM_DIR = str(REPO / "examples" / "maxtext")

PROBE = """
import json, sys, types
import jax
from jax._src import clusters
shim = sys.modules.get("cpu_cluster")
fake = lambda platform, process: types.SimpleNamespace(platform=platform, process_index=process)
prop = getattr(jax.Device, "slice_index", None)
out = {"loaded": shim is not None}
if shim:
    out["first_cluster_env"] = clusters.ClusterEnv._cluster_types[0].__name__
    out["process_count"] = shim.EnvProcessCountCluster.get_process_count()
if isinstance(prop, property):
    out["slices_of_cpu_processes"] = [prop.fget(fake("cpu", p)) for p in range(4)]
    try:
        prop.fget(fake("tpu", 3))
    except AttributeError:
        out["tpu_falls_through"] = True
out["cpu_device_slice"] = getattr(jax.devices()[0], "slice_index", None)
print(json.dumps(out))
"""


def probe(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MTC_")}
    environ.update(PYTHONPATH=SHIM_DIR, JAX_PLATFORMS="cpu", **env)
    done = subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_shim_registers_the_process_count_first_and_slices_by_process_index():
    found = probe(MTC_NUM_PROCESSES="4", MTC_NUM_SLICES="2")
    assert found == {
        "loaded": True,
        "first_cluster_env": "EnvProcessCountCluster",
        "process_count": 4,
        "slices_of_cpu_processes": [0, 0, 1, 1],
        "tpu_falls_through": True,
        "cpu_device_slice": 0,
    }


def test_shim_leaves_single_slice_devices_without_a_slice_index():
    assert probe(MTC_NUM_PROCESSES="2") == {
        "loaded": True,
        "first_cluster_env": "EnvProcessCountCluster",
        "process_count": 2,
        "cpu_device_slice": None,
    }


def test_shim_does_nothing_without_a_process_count():
    assert probe() == {"loaded": False, "cpu_device_slice": None}


def test_shim_refuses_slices_that_do_not_divide_the_processes():
    environ = {
        **os.environ,
        "PYTHONPATH": SHIM_DIR,
        "JAX_PLATFORMS": "cpu",
        "MTC_NUM_PROCESSES": "3",
        "MTC_NUM_SLICES": "2",
    }
    done = subprocess.run([sys.executable, "-c", "pass"], env=environ, capture_output=True, text=True, timeout=120)
    # Python reports a failing sitecustomize and goes on; the message names both variables.
    assert "$MTC_NUM_SLICES=2 does not divide $MTC_NUM_PROCESSES=3" in done.stderr


def test_maxtext_jobset_runs_the_stock_trainer_with_multi_tier_flags():
    flags = jobset_flags()
    assert TRAINER == "maxtext.trainers.pre_train.train"
    assert {f: flags[f] for f in MTC_FLAGS} == {
        "enable_multi_tier_checkpointing": "True",
        "local_checkpoint_directory": "/local",
        "local_checkpoint_period": "20",
        "multi_tier_checkpointing_backup_interval_minutes": "30",
    }
    assert "hardware" not in flags  # MaxText initializes multi-tier checkpointing only on the default path
    with open(os.path.join(SHIM_DIR, "jobset.yaml"), encoding="utf-8") as f:
        pod = next(d for d in yaml.safe_load_all(f) if d)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
            "spec"
        ]
    csi_volumes = {v["name"] for v in pod["volumes"] if v.get("csi", {}).get("driver") == "ramdisk.csi.mtc.dev"}
    mounts = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"] if m["name"] in csi_volumes}
    assert mounts == {flags["local_checkpoint_directory"]}


def test_jobset_flags_refuses_a_container_without_the_trainer(tmp_path):
    jobset = tmp_path / "jobset.yaml"
    jobset.write_text(
        open(os.path.join(SHIM_DIR, "jobset.yaml"), encoding="utf-8")
        .read()
        .replace("maxtext.trainers.pre_train.train", "MaxText.train")
    )
    with pytest.raises(ValueError, match="not python -m maxtext.trainers.pre_train.train"):
        jobset_flags(str(jobset))
