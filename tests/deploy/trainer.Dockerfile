# The training image of `make e2e-deploy` (its context: examples/): a user's JAX job (examples/train.py, Orbax's
# multi-tier checkpointing through ReplicatorCheckpointManager) on CPU. It holds none of mtc: the job talks to the
# node agent only through the files of its ramdisk, as on a real cluster. BASE: the agent image's Debian base.
ARG BASE=localhost/mtc-base:bookworm
FROM ${BASE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/train/bin:$PATH \
    JAX_PLATFORMS=cpu

# The versions make test runs the trainer with (pyproject.toml's client extra, as resolved there).
RUN --mount=type=secret,id=pip-ca,required=false \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && python3 -m venv /opt/train \
 && pip install jax[cpu]==0.10.2 orbax-checkpoint==0.12.8 absl-py \
 && python -c "import jax, orbax.checkpoint"

COPY train.py cpu_cluster.py /train/
WORKDIR /train
ENTRYPOINT ["python", "/train/train.py"]
