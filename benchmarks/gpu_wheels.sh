#!/usr/bin/env bash
# Download the wheels gpu_check.sh needs that the H200 image lacks (Python 3.12, x86-64) into .whl/.
# Run here, in the repo root; .whl/ is git-ignored and travels with the device tool's carry=[".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"; }
# pydantic pins its core exactly: keep the pair in step with each other.
# the doctor's GPU trace reader and what it imports that the image lacks (pandas, networkx are there)
dl HolisticTraceAnalysis==0.5.0 plotly pydot
# fp8 training (Float8Training): torchao's float8 linear layers (abi3 wheel, 3 MB)
dl torchao==0.18.0
dl hjson annotated-types typing-inspection pydantic==2.14.4 pydantic-core==2.50.5 jsonargparse==4.53.0 docstring-parser
# the object-storage benchmark (section 12): moto's S3 server and s3fs, the versions this project's .venv holds
here() { .venv/bin/python -c 'import sys, importlib.metadata as m; print(*(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "$@"; }
dl --platform manylinux_2_34_x86_64 $(here moto boto3 botocore s3transfer jmespath xmltodict responses cryptography cffi \
  pycparser flask flask-cors blinker itsdangerous s3fs aiobotocore aioitertools fsspec)
# deepspeed publishes only an sdist: build a pure-Python wheel of it here (its ops compile on first use).
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8 2>/dev/null \
  || .venv/bin/python -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
du -sh .whl && ls .whl
