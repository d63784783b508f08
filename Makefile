# modelswap — developer and CI entry points. Every target is safe to run twice.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LAB ?= msl
LAB_HOSTS ?= 2
# Hosts that mount one shared model store, e.g. LAB_SHARED_STORE=gpu3,gpu4 (empty: none).
LAB_SHARED_STORE ?=
export MODELSWAP_LAB := $(LAB)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PATH := $(CURDIR)/$(BIN):$(PATH)
LABCTL := $(BIN)/python -m tests.lab.labctl
# The demo's hosts and its load generator share this machine's cores: vLLM on CPU 0, Locust on
# CPU 1, so the client's event loop is not delayed by the server it measures (valid steps).
DEMO_VARS := -e vllm_service_cpu_affinity=0 -e '{"benchmark_cpu_affinity": [1]}'
PYTEST := $(BIN)/python -m pytest

.PHONY: help venv deps lab-up lab-down lab-reset lab-status lint collection-check unit test-unit test-lab test-full test demo collection ee-context clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

venv: $(VENV)/.stamp ## controller virtualenv with requirements*.txt

$(VENV)/.stamp: requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip 2>&1 | grep -v "is ignored: it is neither" || true
	$(BIN)/pip install -q -r requirements.txt -r requirements-test.txt 2>&1 | grep -v "is ignored: it is neither" || true
	$(BIN)/python -c "import ansible, ansible_runner, huggingface_hub, pynvml, locust, pytest, safetensors, tokenizers"
	touch $@

deps: ## host packages the lab and the tests need (systemd-nspawn, debootstrap, zstd, haproxy, rsync; no service is started)
	@command -v systemd-nspawn >/dev/null && command -v debootstrap >/dev/null && command -v zstd >/dev/null \
	  && command -v haproxy >/dev/null && command -v rrsync >/dev/null \
	  || tests/lab/apt_install.sh systemd-container debootstrap zstd haproxy rsync

lab-up: venv deps ## build or reuse the lab: hosts, local Hub, tiny models, vLLM wheelhouse
	$(LABCTL) up --hosts $(LAB_HOSTS) $(if $(LAB_SHARED_STORE),--shared-store $(LAB_SHARED_STORE))

lab-down: venv ## stop and remove the lab (keeps the download caches)
	$(LABCTL) down

lab-reset: venv ## stop what the lab's hosts serve and remove modelswap's configuration (keeps vLLM and the models)
	$(LABCTL) reset

lab-status: venv ## show the lab's hosts and services
	$(LABCTL) status

lint: venv ## ansible-lint (production profile), ansible-doc of every module, the collection's checks
	$(BIN)/ansible-lint --profile production --nocolor
	@for m in plugins/modules/*.py; do n=$$(basename $$m .py); \
	  $(BIN)/ansible-doc -t module modelswap.vllm.$$n >/dev/null || { echo "ansible-doc failed: $$n"; exit 1; }; \
	  echo "ansible-doc ok: modelswap.vllm.$$n"; done
	@for f in plugins/filter/*.yml; do n=$$(basename $$f .yml); \
	  $(BIN)/ansible-doc -t filter modelswap.vllm.$$n >/dev/null || { echo "ansible-doc failed: filter $$n"; exit 1; }; \
	  done; echo "ansible-doc ok: every filter"
	$(MAKE) collection-check

collection-check: venv ## the built collection as a reviewer takes it: changelog, ansible-test sanity (pylint too) and units, docs lint; no lab
	$(BIN)/antsibull-changelog lint
	$(BIN)/antsibull-changelog lint-changelog-yaml changelogs/changelog.yaml
	tests/sanity/run.sh
	tests/sanity/run.sh units
	cd build/sanity/ansible_collections/modelswap/vllm && PATH=$(abspath $(BIN)):$$PATH $(abspath $(BIN))/antsibull-docs lint-collection-docs --plugin-docs .

# Two workers (most tests wait on an ansible-playbook or a local server), then the timing-sensitive
# ones alone.
# deps: the peer copies' tests run the real rsync and rrsync on this machine
test-unit: venv deps ## fast tests: pure logic, fakes only for NVML, the local Hub on loopback
	$(PYTEST) -m "(unit or hub) and not serial" -q -n 2 --durations=15
	$(PYTEST) -m "(unit or hub) and serial" -q --durations=5

test-lab: lab-up ## tests on the lab's hosts (real systemd, SSH, vLLM), the fault campaign's sample
	MODELSWAP_REQUIRE_LAB=1 $(PYTEST) -m "(lab or vllm) and not campaign" -q --durations=15

test-full: lab-up ## the whole lab suite, every fault drill of the campaign included (about an hour)
	MODELSWAP_REQUIRE_LAB=1 $(PYTEST) -m "lab or vllm" -q --durations=15

test: venv deps ## everything: lint, unit, hub, lab (what CI runs)
	$(MAKE) lint
	MODELSWAP_REQUIRE_LAB=1 $(MAKE) test-unit
	$(MAKE) test-lab

collection: venv ## build the modelswap.vllm collection tarball into build/
	mkdir -p build
	$(BIN)/ansible-galaxy collection build --force --output-path build .

ee-context: collection ## execution environment build context (ansible-builder) in build/ee/context
	mkdir -p build/ee
	cp build/modelswap-vllm-$$(awk '/^version:/ {print $$2}' galaxy.yml).tar.gz build/ee/modelswap-vllm.tar.gz
	$(BIN)/ansible-builder create -f execution-environment.yml --context build/ee/context --output-filename Containerfile
	@echo "build the image where a container runtime runs: podman build -t modelswap-ee build/ee/context"

demo: lab-up ## the main job on the lab: serve tiny-a, preview and migrate to tiny-b, benchmark, status
	@echo "== 0/4 reset the lab's hosts (whatever a test run or an earlier demo left serving is stopped)"
	$(LABCTL) reset
	@echo "== 1/4 serve tiny-a on every lab host (install vLLM, fetch, start, prove it serves)"
	$(BIN)/ansible-playbook -i inventory/lab playbooks/migrate.yml $(DEMO_VARS) -e modelswap_serve=tiny-a -e modelswap_benchmark=false
	@echo "== 2/4 the preview: what migrating to tiny-b would do (nothing changes)"
	$(BIN)/ansible-playbook -i inventory/lab playbooks/migrate.yml $(DEMO_VARS) -e modelswap_serve=tiny-b --check --diff
	@echo "== 3/4 migrate to tiny-b one host at a time, then benchmark"
	$(BIN)/ansible-playbook -i inventory/lab playbooks/migrate.yml $(DEMO_VARS) -e modelswap_serve=tiny-b -e modelswap_serial=1
	@echo "== 4/4 the fleet"
	$(BIN)/ansible-playbook -i inventory/lab playbooks/status.yml
	@echo "run records and summaries: results/runs/ (newest last): $$(ls -d results/runs/*/ | tail -1)summary.md"
	@echo "benchmark reports: results/benchmark/<host>/<model>/<commit>/<run>/report.md"

clean: lab-down ## remove the lab and the virtualenv (the lab's caches stay)
	rm -rf $(VENV) build
