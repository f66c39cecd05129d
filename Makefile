# Everything a fresh machine needs: a virtualenv with the project and its test/demo
# dependencies, generated CSI stubs, and the Go tools the tests run against.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TOOLS_DIR ?= $(CURDIR)/.tools
TOOLS  := $(TOOLS_DIR)/bin
STAMP  := $(VENV)/.installed
STUBS_PROTOS := protos/csi.proto protos/pluginregistration.proto

CSI_SANITY     := $(TOOLS)/csi-sanity
FAKE_GCS       := $(TOOLS)/fake-gcs-server
MINIO          := $(TOOLS)/minio
HELM           := $(TOOLS)/helm
KUSTOMIZE      := $(TOOLS)/kustomize
CSI_TEST_PKG   := github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@v5.4.0
FAKE_GCS_PKG   := github.com/fsouza/fake-gcs-server@v1.55.1
# A real S3 server for the tests and benches only (AGPL: never linked or shipped). ~3 min to build, once.
MINIO_PKG      := github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c
HELM_PKG       := helm.sh/helm/v3/cmd/helm@v3.22.0
# Newer kustomize releases need a newer Go than 1.26.
KUSTOMIZE_PKG  := sigs.k8s.io/kustomize/kustomize/v5@v5.7.1

# A real Kubernetes control plane for `make e2e-k8s` (tests/k8s): kube-apiserver, kube-controller-manager and
# kube-scheduler built from k8s.io/kubernetes through the module proxy, and the JobSet controller with its CRD.
# k8s.io/kubernetes is not meant to be a dependency: its go.mod replaces the 31 k8s.io staging modules with
# ./staging directories its module zip lacks. So it is copied somewhere writable, each replace points at the
# published staging module of the same release, and it builds with GOWORK=off (it ships a go.work) and
# -mod=mod (its vendor/ holds only an OWNERS file). Without the version ldflags the server says v0.0.0-master.
K8S_VERSION    := v1.34.4
K8S_STAGING    := v0.34.4
K8S_SRC        := $(TOOLS_DIR)/src/kubernetes-$(K8S_VERSION)
K8S_BINARIES   := kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl
# Their modules (~2 GB) and build cache (~3 GB) go to caches of their own, removed once every binary is built
# (a CI machine's disk is small): a rebuild downloads again.
K8S_GOMODCACHE := $(TOOLS_DIR)/k8s-gomodcache
K8S_GOCACHE    := $(TOOLS_DIR)/k8s-gocache
# Kubernetes' storage e2e suite, built with the binaries and in their caches (below)
E2E_TEST       := $(TOOLS)/e2e-storage.test
K8S_GO         := GOWORK=off GOFLAGS=-mod=mod GOMODCACHE=$(K8S_GOMODCACHE) GOCACHE=$(K8S_GOCACHE)
K8S_LDFLAGS    := $(foreach p,k8s.io/component-base/version k8s.io/client-go/pkg/version,\
                    -X $(p).gitVersion=$(K8S_VERSION) -X $(p).gitMajor=1 -X $(p).gitMinor=34 -X $(p).gitTreeState=clean)
# JobSet v0.10.1 (k8s 0.34.1), built in a writable copy of its module: `go install ...@v0.10.1` fails, as the
# proxy answers its version listing (which go install reads for deprecations) with 403. Its CRD and webhook
# manifests come from the same copy (tests/helpers/kube reads them there: keep JOBSET_VERSION in step with it).
JOBSET_VERSION := v0.10.1
JOBSET_SRC     := $(TOOLS_DIR)/src/jobset-$(JOBSET_VERSION)
JOBSET         := $(TOOLS)/jobset
JOBSET_CONFIG  := $(TOOLS_DIR)/jobset-$(JOBSET_VERSION)
JOBSET_FILES   := crd/bases/jobset.x-k8s.io_jobsets.yaml webhook/manifests.yaml
# Each build's wall time and peak memory, for docs/: /usr/bin/time -v where it exists.
TIMED           = $(if $(wildcard /usr/bin/time),/usr/bin/time -v -o $(TOOLS_DIR)/build-$(notdir $@).time)

# MaxText needs Python >= 3.12: python3.12 on PATH, else pyenv's (make e2e-maxtext only).
MAXTEXT_PYTHON ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),$(shell $(p) -c 'import sys; print("$(p)" if sys.version_info >= (3, 12) else "")' 2>/dev/null)))
MAXTEXT_VENV   := .venv-maxtext
MAXTEXT_STAMP  := $(MAXTEXT_VENV)/.installed

# NVIDIA NVRx local checkpointing, the peer of `make bench`'s torch_vs_nvrx (tests/bench/torch_vs_nvrx.py).
# 0.7.0's wheels are tagged manylinux_2_39 (this glibc may be older, and pip would fall back to 0.4.1, whose
# local checkpointing is CUDA-only in the same places): the wheel is downloaded and its platform tag renamed
# to linux_x86_64 (the wheel holds no compiled code for that part). Python 3.12, as the wheel is cp312.
NVRX         := nvidia-resiliency-ext==0.7.0
NVRX_WHEEL   := nvidia_resiliency_ext-0.7.0-cp312-cp312
NVRX_TORCH   := torch==2.15.0 numpy==2.4.6 PyYAML
NVRX_PYTHON  ?= $(MAXTEXT_PYTHON)
NVRX_VENV    := .venv-nvrx
NVRX_STAMP   := $(NVRX_VENV)/.installed

# The oldest Orbax pyproject.toml accepts, with the JAX that was current at its release on Python 3.11
# (orbax-checkpoint 0.12.3: 2026-08-11; jax 0.10.2: 2026-06-17; jax 0.11 needs Python >= 3.12).
ORBAX_OLDEST        := orbax-checkpoint==0.12.3 jax[cpu]==0.10.2
ORBAX_OLDEST_PYTHON ?= $(PYTHON)
ORBAX_OLDEST_VENV   := .venv-orbax-oldest
ORBAX_OLDEST_STAMP  := $(ORBAX_OLDEST_VENV)/.installed
# The Orbax end-to-end subset: a local restore, and node losses restored from a peer (identical data, a replica).
ORBAX_OLDEST_TESTS  := tests/e2e/test_e2e_orbax.py::test_sigkilled_job_resumes_at_newest_complete_step_with_identical_values \
                       tests/e2e/test_e2e_peer_tier.py::test_data_parallel_job_restores_lost_node_from_identical_peer_without_copies \
                       tests/e2e/test_e2e_peer_tier.py::test_replicated_job_saving_faster_than_it_replicates_restores_lost_node_and_skips_a_corrupt_replica

# The PyTorch venv: the client (mtc_torch, examples/train_torch.py, its integration test in `make test`) and
# the stock TorchTitan trainer (make e2e-torchtitan) share it. torch's Linux wheel is a CUDA build (about 3 GB
# download, 5 GB installed), so there is one such venv, installed without pip's cache (a fresh CI disk ran out
# with two venvs plus the cached wheels). numpy is pinned because DCP over gloo needs it and torch does not
# declare it. The client distribution (clients/torch: mtc_torch) and the project go in with --no-deps (editable).
# Python 3.11 here; torch 2.15's wheels cover 3.10-3.14.
TORCH_PYTHON ?= python3
TORCH_VENV   := .venv-torch
TORCH_STAMP  := $(TORCH_VENV)/.installed
TORCH_PKGS   := torch==2.15.0 numpy==2.4.6 PyYAML==6.0.4 torchtitan==0.3.0

# The mtc-agent image (Dockerfile): docker where a daemon answers, else buildah. BASE_IMAGE is the Dockerfile's
# BASE; `make image-base` makes one from Debian's packages alone (debootstrap), for machines without Docker Hub.
VERSION    := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
# The release's artifacts (make release).
DIST          := dist
IMAGE_ARCHIVE := $(DIST)/mtc-agent-$(VERSION).tar
IMAGE      ?= mtc-agent:$(VERSION)
BASE_IMAGE ?= python:3.11-slim
DEBIAN_SUITE  ?= bookworm
DEBIAN_MIRROR ?= http://deb.debian.org/debian
IMAGE_BASE    ?= localhost/mtc-base:$(DEBIAN_SUITE)
# A CA bundle pip inside the build trusts (a proxy that re-signs TLS), passed as a build secret.
BUILD_CA   ?=
# OCI annotations (org.opencontainers.image.*): the package version, the commit built, and the project's home
# (the chart's), so that `buildah inspect`/`docker inspect` of a pulled image says what it is.
IMAGE_SOURCE := $(shell sed -n 's/^home: //p' charts/mtc/Chart.yaml)
IMAGE_LABELS  = title=mtc-agent version=$(VERSION) source=$(IMAGE_SOURCE) licenses=Apache-2.0 \
                revision=$(shell git rev-parse HEAD 2>/dev/null || echo unknown)
IMAGE_ARGS  = --build-arg BASE=$(BASE_IMAGE) $(if $(BUILD_CA),--secret id=pip-ca$(comma)src=$(BUILD_CA)) -t $(IMAGE) \
              $(foreach l,$(IMAGE_LABELS),--label org.opencontainers.image.$(l))
comma := ,

.PHONY: setup stubs tools host-tools k8s-tools k8s-node-tools e2e-k8s e2e-deploy deploy-images e2e-operations etcd test test-fast demo torch-setup bench e2e-maxtext e2e-torchtitan e2e-orbax-oldest chaos clean image image-base chart-archive client-wheel release release-check client-compat

setup: $(STAMP)

# The programs the tests run on this machine come from Debian's packages, listed with their packages in one place,
# tests/helpers/host_tools.py, by suite (local, etcd, node). Those missing are installed (apt-get install, then after
# apt-get update should that fail); then the preflight names each tool still missing (or iptables' legacy backend)
# on a line of its own, with its package, and stops make before minutes of setup and tests. host-tools comes first
# in a target's prerequisites, with the suites of that target (HOST_SUITES, set for e2e-k8s).
HOST_TOOLS   := $(PYTHON) -m tests.helpers.host_tools
HOST_SUITES  := local
host_tools    = pkgs=$$($(HOST_TOOLS) --packages $(1)) && \
    { [ -z "$$pkgs" ] || ! command -v apt-get >/dev/null || apt-get install -y -q $$pkgs || \
      { apt-get update -q && apt-get install -y -q $$pkgs; } || true; } && $(HOST_TOOLS) --check $(1)

host-tools:
	@$(call host_tools,$(HOST_SUITES))

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,client]'
	touch $@

torch-setup: $(TORCH_STAMP)

$(TORCH_STAMP): pyproject.toml clients/torch/pyproject.toml
	$(TORCH_PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/pip install -q --upgrade pip
	$(TORCH_VENV)/bin/pip install -q --no-cache-dir $(TORCH_PKGS)
	$(TORCH_VENV)/bin/pip install -q --no-deps -e . -e clients/torch
	touch $@

# One stub pair per vendored proto: csi.proto (the CSI spec) and pluginregistration.proto (the kubelet's plugin
# registration, k8s.io/kubelet; served by csi_driver/registration.py). The stubs are committed, so that the wheel,
# the sdist and `pip install git+URL` build with setuptools alone, offline; tests/unit/test_generated_stubs.py fails
# when they differ from what the pinned grpcio-tools generates: `make stubs` after changing a .proto or the pin.
stubs: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(STUBS_PROTOS)

tools: $(CSI_SANITY) $(FAKE_GCS) $(MINIO) $(HELM) $(KUSTOMIZE)

$(CSI_SANITY):
	GOBIN=$(TOOLS) go install $(CSI_TEST_PKG)

$(FAKE_GCS):
	GOBIN=$(TOOLS) go install $(FAKE_GCS_PKG)

$(MINIO):
	GOBIN=$(TOOLS) go install $(MINIO_PKG)

$(HELM):
	GOBIN=$(TOOLS) go install $(HELM_PKG)

$(KUSTOMIZE):
	GOBIN=$(TOOLS) go install $(KUSTOMIZE_PKG)

k8s-tools: etcd $(addprefix $(TOOLS)/,$(K8S_BINARIES)) $(JOBSET) $(JOBSET_CONFIG)/manifests.yaml $(E2E_TEST)
	if [ -d $(K8S_GOMODCACHE) ]; then GOMODCACHE=$(K8S_GOMODCACHE) go clean -modcache; fi
	rm -rf $(K8S_GOCACHE)

# Debian's etcd-server (3.4) is what the control plane stores its objects in.
etcd:
	@$(call host_tools,etcd)

$(K8S_SRC)/go.mod:
	rm -rf $(K8S_SRC) && mkdir -p $(dir $(K8S_SRC))
	dir=$$($(K8S_GO) go mod download -json k8s.io/kubernetes@$(K8S_VERSION) | sed -n 's/^\t"Dir": "\(.*\)",$$/\1/p') && \
	    test -n "$$dir" && cp -r "$$dir" $(K8S_SRC).tmp
	chmod -R u+w $(K8S_SRC).tmp
	cd $(K8S_SRC).tmp && for m in $$(sed -n 's|^[[:space:]]*\(k8s.io/[^ ]*\) => ./staging/.*|\1|p' go.mod); do \
	    $(K8S_GO) go mod edit -replace $$m=$$m@$(K8S_STAGING); done
	mv $(K8S_SRC).tmp $(K8S_SRC)

# A real node (tests/helpers/kube/node.py): the kubelet, Debian's containerd and runc (crun fails here: "cgroups
# in hybrid mode not supported"), CNI's loopback plugin and busybox for the locally built images.
k8s-node-tools: k8s-tools
	@$(call host_tools,node)

$(addprefix $(TOOLS)/,$(K8S_BINARIES)): $(TOOLS)/%: $(K8S_SRC)/go.mod
	mkdir -p $(TOOLS)
	cd $(K8S_SRC) && $(K8S_GO) $(TIMED) go build -o $@.tmp -ldflags "$(K8S_LDFLAGS)" ./cmd/$*
	mv $@.tmp $@

$(JOBSET_SRC)/go.mod:
	rm -rf $(JOBSET_SRC) $(JOBSET_SRC).tmp && mkdir -p $(dir $(JOBSET_SRC))
	dir=$$($(K8S_GO) go mod download -json sigs.k8s.io/jobset@$(JOBSET_VERSION) | sed -n 's/^\t"Dir": "\(.*\)",$$/\1/p') && \
	    test -n "$$dir" && cp -r "$$dir" $(JOBSET_SRC).tmp
	chmod -R u+w $(JOBSET_SRC).tmp && mv $(JOBSET_SRC).tmp $(JOBSET_SRC)

$(JOBSET): $(JOBSET_SRC)/go.mod
	mkdir -p $(TOOLS)
	cd $(JOBSET_SRC) && $(K8S_GO) $(TIMED) go build -o $@.tmp .
	mv $@.tmp $@

$(JOBSET_CONFIG)/manifests.yaml: $(JOBSET_SRC)/go.mod
	rm -rf $(JOBSET_CONFIG) && mkdir -p $(JOBSET_CONFIG).tmp
	cp $(foreach f,$(JOBSET_FILES),$(JOBSET_SRC)/config/components/$(f)) $(JOBSET_CONFIG).tmp/
	mv $(JOBSET_CONFIG).tmp $(JOBSET_CONFIG)

# A real API server, controller-manager, scheduler and JobSet controller on 127.0.0.1, and a real kubelet node on
# 127.0.0.2: all of tests/k8s, with the README's example JobSet trained through failures. About 10 min from a
# fresh machine (7 to build, 2 to run); run by .ci/run after `make test`.
e2e-k8s: HOST_SUITES := local etcd node
e2e-k8s: host-tools setup k8s-node-tools
	PATH=$(TOOLS):$$PATH $(BIN)/python -m pytest -q -p no:cacheprovider tests/k8s

# The product deployed as users deploy it (tests/deploy): the README's Kubernetes quick start, word for word, on the
# real control plane and real kubelet nodes, each node in a mount namespace of its own (its own /var/lib/kubelet),
# the whole cluster in a network namespace of its own (unshare --net) with a pod network (CNI ptp), kube-proxy and
# CoreDNS; the images built here (buildah) and imported into each node's containerd instead of pulled. The Debian
# base (debootstrap, about a minute) is cached as an OCI archive beside the Kubernetes builds; the agent, trainer and
# livenessprobe stand-in images are built from this tree every run. The CA bundle lets pip inside the builds through
# a proxy that re-signs TLS (BUILD_CA, as for `make image`).
DEPLOY_IMAGES      := $(CURDIR)/build/deploy
IMAGE_BASE_ARCHIVE := $(TOOLS_DIR)/images/mtc-base-$(DEBIAN_SUITE).tar
DEPLOY_CA          := $(or $(BUILD_CA),$(wildcard /etc/ssl/certs/ca-certificates.crt))
DEPLOY_BUILD        = buildah bud -q --layers=false $(if $(DEPLOY_CA),--secret id=pip-ca$(comma)src=$(DEPLOY_CA))
COREDNS            := $(TOOLS)/coredns
COREDNS_PKG        := github.com/coredns/coredns@v1.14.7

$(IMAGE_BASE_ARCHIVE):
	$(MAKE) image-base
	mkdir -p $(dir $@) && buildah push -q $(IMAGE_BASE) oci-archive:$@.tmp:$(IMAGE_BASE) && mv $@.tmp $@

$(COREDNS):
	GOBIN=$(TOOLS) $(TIMED) go install $(COREDNS_PKG)

# The previous build's images are removed first: rebuilt under the same tags, they stayed behind untagged (2 GB a run).
deploy-images: $(IMAGE_BASE_ARCHIVE)
	buildah rmi -f $(foreach i,mtc-agent livenessprobe-standin mtc-trainer,localhost/$(i):$(VERSION)) >/dev/null 2>&1 || true
	buildah pull -q oci-archive:$(IMAGE_BASE_ARCHIVE) >/dev/null
	$(MAKE) image BASE_IMAGE=$(IMAGE_BASE) IMAGE=localhost/mtc-agent:$(VERSION) BUILD_CA=$(DEPLOY_CA)
	$(DEPLOY_BUILD) -f tests/deploy/livenessprobe.Dockerfile --build-arg AGENT=localhost/mtc-agent:$(VERSION) \
	    -t localhost/livenessprobe-standin:$(VERSION) tests/deploy
	$(DEPLOY_BUILD) -f tests/deploy/trainer.Dockerfile --build-arg BASE=$(IMAGE_BASE) -t localhost/mtc-trainer:$(VERSION) examples
	rm -rf $(DEPLOY_IMAGES) && mkdir -p $(DEPLOY_IMAGES)
	for i in mtc-agent livenessprobe-standin mtc-trainer; do \
	    buildah push -q localhost/$$i:$(VERSION) oci-archive:$(DEPLOY_IMAGES)/$$i.tar:localhost/$$i:$(VERSION) || exit 1; done

# Kubernetes' own storage e2e suite (tests/deploy/test_storage_suite.py, run by e2e-deploy after the quick start):
# e2e-storage.test is k8s.io/kubernetes' test/e2e package (same source, same BeforeSuite and flags) with only the
# storage suite's External Storage cases linked: its three files are copied beside it and every other suite's blank
# import (and the cloud providers' file) left out, so it builds in about 3 min instead of the whole e2e.test's 21
# (docs/development.md has the figures). Built with Kubernetes' own tags, stripped as hack/lib/golang.sh builds it,
# without go test's vet of Kubernetes' code, by k8s-tools after the binaries, whose modules and compiled packages it
# shares, before their caches go.
E2E_STORAGE := test/e2e/mtc-storage-suite

$(E2E_TEST): $(K8S_SRC)/go.mod
	mkdir -p $(dir $@)
	rm -rf $(K8S_SRC)/$(E2E_STORAGE) && mkdir -p $(K8S_SRC)/$(E2E_STORAGE)
	cp $(addprefix $(K8S_SRC)/test/e2e/,e2e.go e2e_test.go suites.go) $(K8S_SRC)/$(E2E_STORAGE)/
	sed -i -E '/^\s*_ "k8s\.io\/kubernetes\/test\/e2e\//{/e2e\/(feature|storage\/external|framework\/[a-z\/]+)"$$/!d}' \
	    $(K8S_SRC)/$(E2E_STORAGE)/e2e_test.go
	grep -q '_ "k8s.io/kubernetes/test/e2e/storage/external"$$' $(K8S_SRC)/$(E2E_STORAGE)/e2e_test.go
	cd $(K8S_SRC) && $(K8S_GO) $(TIMED) go test -c -vet=off -tags selinux,notest,grpcnotrace -ldflags "-s -w $(K8S_LDFLAGS)" \
	    -o $@.tmp ./$(E2E_STORAGE)
	mv $@.tmp $@

e2e-deploy: HOST_SUITES := local etcd node deploy
e2e-deploy: host-tools setup tools k8s-node-tools $(COREDNS) deploy-images chart-archive
	PATH=$(TOOLS):$$PATH MTC_DEPLOY_IMAGES=$(DEPLOY_IMAGES) MTC_DEPLOY_CHART=$(CURDIR)/$(DIST)/mtc-$(VERSION).tgz \
	    MTC_E2E_TEST=$(E2E_TEST) unshare --net -- $(BIN)/python -m pytest -q -p no:cacheprovider --durations=10 tests/deploy

# The longest end-to-end tests, run by .ci/run after `make test` (which leaves them out to stay near 20 minutes
# on 2 cores): an operator's procedures (a rolling upgrade and rollback across releases, a token rotation) and
# the pressure cases (a ramdisk sized exactly by the rule, read-once restores after a cluster loss, the chaos
# suite's fixed seed, a parity group losing more than it tolerates, a PyTorch job restored at another node count)
# and the slowest tests of the peer and backup tiers (a node lost while saving faster than it replicates; a store
# answering after 20 s; the backup RPO through a node loss and a cluster loss, and an HSDP job's backup cut by a
# node loss and committed by its data-parallel peer's reference), named by test ID.
# About 18 min.
E2E_OPERATIONS := tests/e2e/test_e2e_upgrade.py tests/e2e/test_e2e_token_rotation.py \
                  tests/e2e/test_e2e_ramdisk_sizing.py tests/e2e/test_e2e_restore_fan_out.py tests/e2e/test_chaos.py \
                  tests/e2e/test_e2e_parity_beyond.py tests/e2e/test_e2e_pytorch_elastic.py \
                  tests/e2e/test_e2e_peer_tier.py::test_node_lost_while_saving_faster_than_it_replicates_restores_a_step_within_the_bound \
                  tests/e2e/test_e2e_backup_tier.py::test_a_store_answering_after_20_s_slows_no_save_and_backups_then_complete_and_restore \
                  tests/e2e/test_e2e_backup_tier.py::test_rpo_a_node_lost_mid_backup_then_the_cluster_30_s_later_restores_within_a_backup_interval_of_safe \
                  tests/e2e/test_e2e_pytorch.py::test_hsdp_job_without_copies_completes_a_backup_cut_by_a_node_loss_and_restores_it_after_a_cluster_loss

# The import contracts, the linter, the format check and the type checker first (pyproject.toml: [tool.importlinter],
# [tool.ruff], [tool.mypy]; mtc_torch is type-checked against the PyTorch venv's torch): a finding fails before any
# test runs. The 20 slowest tests are listed at the end: the suite is kept under about 20 minutes on 2 cores.
test: host-tools setup tools torch-setup
	$(BIN)/lint-imports --no-cache --no-logo
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy --python-executable $(TORCH_VENV)/bin/python mtc_torch
	PATH=$(TOOLS):$$PATH $(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 \
	    $(foreach t,$(E2E_OPERATIONS),$(if $(findstring ::,$(t)),--deselect=$(t),--ignore=$(t)))

e2e-operations: host-tools setup tools
	PATH=$(TOOLS):$$PATH $(BIN)/python -m pytest -q -p no:cacheprovider $(E2E_OPERATIONS)

# The unit layer only (tests/unit: no processes, no mounts, no Go tools), for the edit-test loop.
test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m unit

# The unit layer on another Python minor version, in a virtualenv of its own built from scratch each run
# (.venv-pyX.Y: the project with [dev], from PyPI or pip's cache): `make test-py3.13`, `make test-py3.12`.
# pyproject.toml claims 3.11 on; `make test` runs 3.11 (.venv), this the others. Python X.Y is pythonX.Y on PATH,
# else pyenv's newest X.Y.*. Not part of `make test` (about 2 min; docs/development.md).
test-py%:
	@py=$$(for p in python$* $(HOME)/.pyenv/versions/$*.*/bin/python$*; do \
	    $$p -c 'import sys; assert sys.version_info[:2] == tuple(map(int, "$*".split(".")))' 2>/dev/null && echo $$p; done | tail -1); \
	test -n "$$py" || { echo "No Python $* found (python$* on PATH or ~/.pyenv/versions/$*.*)"; exit 1; }; \
	set -x; rm -rf .venv-py$* && $$py -m venv .venv-py$* && .venv-py$*/bin/pip install -q --upgrade pip && \
	    .venv-py$*/bin/pip install -q -e '.[dev]' && .venv-py$*/bin/python -m pytest -q -p no:cacheprovider -m unit tests/unit

# FRAMEWORK=pytorch: the PyTorch job (torchrun, mtc_torch) instead of the JAX one.
FRAMEWORK ?= jax
demo: setup $(if $(filter pytorch,$(FRAMEWORK)),torch-setup)
	$(BIN)/python -m examples.demo --framework $(FRAMEWORK)

# Each entry is a module of tests/bench and its flags.
BENCHES := ramdisk_throughput "peer_restore --cores" "peer_restore --gib 4 --repetitions 5" step_checksums \
           backup_restore "restore_fan_out --repetitions 3 --store-mbit 200" replication_overhead restore_mttr agent_idle "coordinator_scale --nodes 1000 --seconds 30" \
           "torch_vs_nvrx --python $(NVRX_VENV)/bin/python" "torch_gpu --python $(NVRX_VENV)/bin/python" elastic_restore goodput \
           parity_codec parity_restore "parity_restore --redundancy rs:4:2" recovery_snapshot

# Every bench runs, whatever the ones before it returned (coordinator_scale and agent_idle exit 1 on a missed goal;
# the others print their misses); those that exited non-zero are listed at the end.
bench: host-tools setup tools $(NVRX_STAMP)
	failed=""; for b in $(BENCHES); do echo "== $$b"; PATH=$(TOOLS):$$PATH $(BIN)/python -m tests.bench.$$b || failed="$$failed; $$b"; done; \
	if [ -n "$$failed" ]; then echo "== benches that exited non-zero: $${failed#; }"; exit 1; fi

$(NVRX_STAMP):
	@test -n "$(NVRX_PYTHON)" || { echo "No Python >= 3.12 found (python3.12 or ~/.pyenv/versions/3.12*): NVRx 0.7.0's wheel is cp312; set NVRX_PYTHON=..."; exit 1; }
	$(NVRX_PYTHON) -m venv $(NVRX_VENV)
	$(NVRX_VENV)/bin/pip install -q --upgrade pip
	rm -rf $(NVRX_VENV)/wheel && $(NVRX_VENV)/bin/pip download -q --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 \
	    --python-version 3.12 -d $(NVRX_VENV)/wheel '$(NVRX)'
	mv $(NVRX_VENV)/wheel/$(NVRX_WHEEL)-manylinux_2_39_x86_64.whl $(NVRX_VENV)/wheel/$(NVRX_WHEEL)-linux_x86_64.whl
	$(NVRX_VENV)/bin/pip install -q $(foreach p,$(NVRX_TORCH),'$(p)') $(NVRX_VENV)/wheel/$(NVRX_WHEEL)-linux_x86_64.whl
	touch $@

# The stock MaxText trainer on CPU through a preemption and a node loss (tests/drivers/e2e_maxtext.py); not
# part of `make test`. maxtext's wheel declares its dependencies only in extras: [tpu] brings
# jax, orbax-checkpoint and the rest (libtpu stays unused under JAX_PLATFORMS=cpu).
e2e-maxtext: host-tools setup $(MAXTEXT_STAMP)
	$(BIN)/python -m tests.drivers.e2e_maxtext --python $(MAXTEXT_VENV)/bin/python

$(MAXTEXT_STAMP):
	@test -n "$(MAXTEXT_PYTHON)" || { echo "No Python >= 3.12 found (python3.12 or ~/.pyenv/versions/3.12*): MaxText 0.2.5 needs it; set MAXTEXT_PYTHON=..."; exit 1; }
	$(MAXTEXT_PYTHON) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_VENV)/bin/pip install -q --upgrade pip
	$(MAXTEXT_VENV)/bin/pip install -q 'maxtext[tpu]==0.2.5'
	touch $@

# The stock TorchTitan trainer (its llama3 debug model) on CPU, 2 nodes x 2 processes under torchrun,
# checkpointing through mtc_torch, through a preemption and a node loss (tests/drivers/e2e_torchtitan.py); not
# part of `make test`. It runs from the PyTorch venv above.
e2e-torchtitan: host-tools setup $(TORCH_STAMP)
	$(BIN)/python -m tests.drivers.e2e_torchtitan --python $(TORCH_VENV)/bin/python

# The Orbax end-to-end subset against the oldest claimed orbax-checkpoint, in its own virtualenv (the
# agents and trainers run on its Python too).
e2e-orbax-oldest: host-tools $(ORBAX_OLDEST_STAMP)
	$(ORBAX_OLDEST_VENV)/bin/python -c 'import importlib.metadata as m; print("orbax-checkpoint", m.version("orbax-checkpoint"), "jax", m.version("jax"), "jaxlib", m.version("jaxlib"))'
	PATH=$(TOOLS):$$PATH $(ORBAX_OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(ORBAX_OLDEST_TESTS)

$(ORBAX_OLDEST_STAMP): pyproject.toml
	$(ORBAX_OLDEST_PYTHON) -m venv $(ORBAX_OLDEST_VENV)
	$(ORBAX_OLDEST_VENV)/bin/pip install -q --upgrade pip
	$(ORBAX_OLDEST_VENV)/bin/pip install -q -e '.[client]' $(foreach p,$(ORBAX_OLDEST),'$(p)') 'pytest>=8' 'pytest-asyncio>=0.23'
	touch $@

# A long seeded random fault sequence per variant (the seed is printed; replay with --seed).
CHAOS_FAULTS ?= 20
CHAOS_ARGS   ?=
chaos: HOST_SUITES := local etcd
chaos: host-tools setup tools k8s-tools
	rc=0; for v in dp2 dp1 xor rs grants kube; do $(BIN)/python -m tests.drivers.chaos --faults $(CHAOS_FAULTS) --variant $$v $(CHAOS_ARGS) || rc=1; done; exit $$rc

image:
	@if command -v docker >/dev/null && docker info >/dev/null 2>&1; then \
	    set -x; docker build $(IMAGE_ARGS) .; \
	elif command -v buildah >/dev/null; then \
	    set -x; buildah bud $(IMAGE_ARGS) .; \
	else echo "make image needs docker (with a running daemon) or buildah (apt-get install buildah)"; exit 1; fi

# The release's artifacts under dist/, each of the version in pyproject.toml: the agent's wheel and sdist and the
# client's wheel (python -m build; clients/torch has no sdist), the chart (helm package: mtc-$(VERSION).tgz) and
# the agent's image (make image, saved as dist/mtc-agent-$(VERSION).tar: an OCI archive from buildah, docker save's
# from docker). `make release-check` installs each from dist/ (tests/packaging); `make client-compat` installs the
# client's wheel beside each tested torch. The version is cut by hand (pyproject.toml, clients/torch/pyproject.toml,
# charts/mtc/Chart.yaml: tests/unit/test_distributions.py checks they agree).
release: setup $(HELM)
	rm -rf $(DIST) && $(MAKE) client-wheel chart-archive
	$(BIN)/python -m build -q --outdir $(DIST) .
	$(MAKE) image
	@if command -v docker >/dev/null && docker info >/dev/null 2>&1; then \
	    set -x; docker save -o $(IMAGE_ARCHIVE) $(IMAGE); \
	else set -x; buildah push -q $(IMAGE) oci-archive:$(IMAGE_ARCHIVE):$(IMAGE); fi
	ls -l $(DIST)

# The chart as a release ships it; `make e2e-deploy` installs it from this archive.
chart-archive: $(HELM)
	rm -f $(DIST)/mtc-*.tgz && $(HELM) package charts/mtc --destination $(DIST)

client-wheel: setup
	rm -f $(DIST)/mtc_torch-*.whl && $(BIN)/python -m build -q --wheel --outdir $(DIST) clients/torch

# The wheel in a clean venv with its dependencies (mtc --version, mtc node --help), the chart from its .tgz, the
# image archive's labels and tag (tests/packaging/test_artifacts.py). 2026-11-28, 2 shared cores, buildah on the
# local Debian base: make release 2 min 11 s (most of it the image), these tests 70 s (the clean venv's
# pip install 63 s, its downloads from PyPI included).
release-check: release
	PATH=$(TOOLS):$$PATH MTC_DIST=$(DIST) $(BIN)/python -m pytest -q -p no:cacheprovider tests/packaging/test_artifacts.py

# The client's wheel installed into a clean venv that already holds each torch of CLIENT_TORCH (the oldest the
# client accepts and the newest served), then the client tests against that venv (tests/packaging/test_client_compat.py).
# Not in CI: each torch is a CUDA build from PyPI (about 3 GB with its nvidia packages, 5 GB installed): 14 min for
# both on 2 shared cores (2026-11-28; docs/development.md).
CLIENT_TORCH ?= 2.11.0 2.15.0
client-compat: client-wheel
	MTC_DIST=$(DIST) MTC_CLIENT_TORCH="$(CLIENT_TORCH)" $(BIN)/python -m pytest -q -p no:cacheprovider -rA \
	    tests/packaging/test_client_compat.py

# python3-venv: the Dockerfile installs into a virtualenv; util-linux and mount: the ramdisks.
image-base:
	@command -v debootstrap >/dev/null && command -v buildah >/dev/null || { echo "make image-base needs debootstrap and buildah (apt-get install debootstrap buildah)"; exit 1; }
	rm -rf build/image-base && mkdir -p build
	debootstrap --variant=minbase --include=python3,python3-venv,util-linux,mount $(DEBIAN_SUITE) build/image-base $(DEBIAN_MIRROR)
	rm -rf build/image-base/var/lib/apt/lists/* build/image-base/var/cache/apt/*.bin
	ctr=$$(buildah from scratch) && buildah copy $$ctr build/image-base / >/dev/null && \
	    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin $$ctr && \
	    buildah commit --rm $$ctr $(IMAGE_BASE)
	rm -rf build/image-base

clean:
	rm -rf $(VENV) $(TORCH_VENV) $(MAXTEXT_VENV) $(NVRX_VENV) $(ORBAX_OLDEST_VENV) .venv-py* .tools dist
