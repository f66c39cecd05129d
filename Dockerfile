# mtc-agent: the node agent (CSI plugin, replicator, pre-fetcher) and the coordinator.
#   make image IMAGE=REGISTRY/mtc-agent:TAG      (docker build, else buildah bud; docs/install.md)
#   node:        mtc node ...        coordinator:  mtc coordinator ...
# BASE: any Debian-based image with Python 3.11+ and its venv module; `make image-base` makes one from
# Debian's packages alone (debootstrap), for machines that cannot pull from Docker Hub.
ARG BASE=python:3.11-slim
FROM ${BASE}

# mount/umount (util-linux) for the tmpfs ramdisks.
RUN apt-get update \
 && apt-get install -y --no-install-recommends util-linux mount \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/mtc/bin:$PATH

WORKDIR /src

# Only what the package needs (keeps .venv, tests and caches out of the image).
COPY pyproject.toml ./
COPY csi_driver/ csi_driver/
COPY prefetch/ prefetch/
COPY replicator/ replicator/
COPY protos/ protos/

# A virtualenv, so that a Debian base's Python (which refuses pip installs of its own, PEP 668) serves too.
# The gRPC stubs are committed in protos/ (tests/unit/test_generated_stubs.py checks them against the protos).
# The optional build secret `pip-ca` is a CA bundle pip trusts, for networks whose proxy re-signs TLS
# (`make image BUILD_CA=FILE`); it stays out of the image.
RUN --mount=type=secret,id=pip-ca,required=false \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && python3 -m venv /opt/mtc \
 && pip install . \
 && cd / && rm -rf /src \
 && python -c "import protos.csi_pb2_grpc, protos.pluginregistration_pb2_grpc, replicator.cli" \
 && command -v mtc && command -v mount && command -v umount

WORKDIR /
ENTRYPOINT ["mtc"]
