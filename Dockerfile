# One image for all three Ferry services (api, scheduler, worker); compose.yaml picks the command.
# The worker needs a CUDA build of torch; api and scheduler never import it.
FROM python:3.11-slim-bookworm

ARG TORCH_SPEC="torch==2.11.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cu130"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Triton builds its small launcher stubs with a C compiler at run time.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 ferry

WORKDIR /opt/ferry

# torch first and alone: the largest layer, and the one that changes least often. Its version is
# pinned by the TORCH_SPEC build argument.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"

COPY pyproject.toml README.md ./
COPY ferry ./ferry
COPY shared ./shared
COPY services ./services
COPY kernels ./kernels
COPY plan ./plan
# the project itself, with its extra for CUDA (fla-core); versions come from pyproject.toml
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[cuda]"

USER 10001
ENV FERRY_CACHE_DIR=/home/ferry/.cache/ferry
EXPOSE 8000 8001 8002
ENTRYPOINT ["ferry"]
CMD ["serve", "--host", "0.0.0.0"]
