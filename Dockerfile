# mtc-agent: the node agent (CSI plugin, replicator, pre-fetcher) and the coordinator.
#   docker build -t mtc-agent:latest .
#   node:        mtc node ...        coordinator:  mtc coordinator ...
FROM python:3.11-slim

# mount/umount (util-linux) for the tmpfs ramdisks.
RUN apt-get update \
 && apt-get install -y --no-install-recommends util-linux mount \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src

# Only what the package needs (keeps .venv, tests and caches out of the image).
COPY pyproject.toml ./
COPY csi_driver/ csi_driver/
COPY prefetch/ prefetch/
COPY replicator/ replicator/
COPY protos/ protos/

# CSI stubs are generated at build time with the grpcio-tools that matches the pinned
# grpcio (see pyproject.toml), then the build-only tool is removed again.
RUN pip install grpcio-tools==1.85.1 \
 && python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. protos/csi.proto \
 && pip install . \
 && pip uninstall -y grpcio-tools \
 && cd / && rm -rf /src \
 && python -c "import protos.csi_pb2_grpc, replicator.cli" \
 && command -v mtc && command -v mount && command -v umount

WORKDIR /
ENTRYPOINT ["mtc"]
