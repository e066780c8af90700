#!/usr/bin/env bash
# Wheels the GPU machine's image lacks (or holds at other versions), for scripts/device_check.sh:
# downloaded here into .whl/ (git-ignored; pass `carry: [".whl"]` to the device run) for its
# Python 3.12 on x86-64, at the versions installed here where this machine has the package.
#
#   bash scripts/device_wheels.sh
set -eu
cd "$(dirname "$0")/.."
PACKAGES=(fastapi starlette uvicorn pydantic pydantic_core annotated-types annotated-doc
          typing-inspection openai jiter distro sniffio httpx httpcore anyio httpx2 httpcore2
          truststore opentelemetry-api pyzmq msgspec pytest-reportlog transformers
          huggingface_hub tokenizers hypothesis-jsonschema jsonschema referencing
          jsonschema-specifications rpds-py)
SPECS=$(python3 - "${PACKAGES[@]}" <<'PY'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(name)
PY
)
mkdir -p .whl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --dest .whl --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $SPECS
ls .whl
