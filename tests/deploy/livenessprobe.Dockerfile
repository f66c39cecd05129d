# A stand-in for the chart's livenessprobe sidecar (registry.k8s.io/sig-storage/livenessprobe), which no registry
# here serves and the Go module proxy refuses (403): the same flags and the same contract (GET /healthz on
# --health-port answers 200 while the CSI driver's Probe on --csi-address answers ready), on the agent image's
# Python and CSI stubs. Only `make e2e-deploy` builds it (its context: tests/deploy).
ARG AGENT=localhost/mtc-agent:latest
FROM ${AGENT}
COPY livenessprobe_standin.py /opt/livenessprobe_standin.py
ENTRYPOINT ["python", "/opt/livenessprobe_standin.py"]
