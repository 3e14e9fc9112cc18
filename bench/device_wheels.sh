#!/usr/bin/env bash
# Makes what the device calls of bench/pending_gpu_run.sh carry (`carry [".whl", ".cmp"]`), both ignored by git,
# so that a new checkout, which has neither, gets them back in one command (run from the repository root here):
# - .whl/: the shared wheels the device lacks (../shared/wheels: pyzmq, msgspec, structlog, pytest-asyncio, fla-core)
#   and the clients the serve steps need, for the device's Python 3.12 (the newest openai/anthropic need httpx2
#   and opentelemetry, which the device lacks, hence the pins);
# - .cmp/static_pool: main 0eefdb5's host kernel sources (the static split PART=contention compares against).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
grep -qx '/.cmp/' .git/info/exclude 2>/dev/null || echo /.cmp/ >> .git/info/exclude
mkdir -p .whl .cmp/static_pool
cp ../shared/wheels/*.whl .whl/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  openai==1.109.1 anthropic==0.69.0 pydantic==2.11.7 pydantic-core==2.33.2 typing-inspection annotated-types jiter \
  distro sniffio docstring-parser py-spy==0.4.2
for f in $(git ls-tree --name-only 0eefdb5 kernels/host_experts_c/); do
  git show "0eefdb5:$f" > ".cmp/static_pool/$(basename "$f")"
done
ls .whl .cmp/static_pool
