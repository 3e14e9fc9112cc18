# One image for all three Ferry services (api, scheduler, worker); compose.yaml picks the command.
# The worker needs a CUDA build of torch; api and scheduler never import it.
FROM python:3.11-slim-bookworm

# The CUDA variant of the torch wheel: CUDA 13.0. Its version is not chosen here but in constraints.txt,
# which `make` installs from too, so the image runs the torch the test suite ran. A CPU-only image (the
# demo, compose.cpu.yaml) takes the CPU build instead, several GB less; it is still about 2.75 GB, triton
# (1 GB installed) included, which Ferry's kernels import on CPU too:
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu docker compose build
ARG TORCH_INDEX="https://download.pytorch.org/whl/cu130"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Triton builds its small launcher stubs with a C compiler at run time, and `pip install` below builds the
# host expert kernel (kernels/host_experts_c/: C, pthreads and libm only) with the same gcc and libc6-dev.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Every directory compose.yaml mounts exists here, owned by the image's user: Docker seeds an empty named
# volume from the image's directory, owner included, and makes one the image lacks root-owned, which uid
# 10001 cannot write (the demo's model cache, FERRY_CACHE_DIR below).
RUN useradd --create-home --uid 10001 ferry \
    && mkdir -p /home/ferry/.cache/ferry /model \
    && chown ferry:ferry /home/ferry/.cache /home/ferry/.cache/ferry /model

WORKDIR /opt/ferry

# torch first and alone: the largest layer, and the one that changes least often; pinned by constraints.txt
COPY constraints.txt ./
# hadolint ignore=DL3013
RUN pip install --no-cache-dir -c constraints.txt torch --index-url "${TORCH_INDEX}"

COPY pyproject.toml README.md ./
COPY ferry ./ferry
COPY shared ./shared
COPY services ./services
COPY kernels ./kernels
COPY plan ./plan
# the project itself, with its extra for CUDA (fla-core) unless torch is the CPU build (fla's kernels
# cannot run on CPU tensors); the constraints keep pip from replacing torch
# hadolint ignore=DL3013
RUN case "${TORCH_INDEX}" in */cpu) extras="" ;; *) extras="[cuda]" ;; esac \
    && pip install --no-cache-dir -c constraints.txt ".${extras}"

USER 10001
ENV FERRY_CACHE_DIR=/home/ferry/.cache/ferry
EXPOSE 8000 8001 8002
# /health of whichever command runs: FERRY_HEALTH_PORT (scheduler, worker), else FERRY_PORT (api, serve), else 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-m", "ferry.services.healthcheck"]
ENTRYPOINT ["ferry"]
# Without arguments: the built-in demo model on every interface of the container (publish the port on
# loopback, as compose.yaml does). Without FERRY_API_KEY the api says at start that it is open.
CMD ["serve", "--host", "0.0.0.0"]
