#!/usr/bin/env bash
# Runs the vLLM hash reference's test (pytest; Debian's python3-pytest and python3-cbor2).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3 -m pytest -q -p no:cacheprovider "$here/test_vllm_hash_ref.py"
