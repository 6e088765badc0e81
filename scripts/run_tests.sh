#!/usr/bin/env bash
# The test suite, from a fresh clone: installs what it needs, then runs pytest.
# GPU tests (marked `gpu`) skip themselves on machines without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -r requirements.txt
python3 -m pytest -q "$@"
