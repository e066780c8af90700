#!/usr/bin/env bash
# Install the package with its test extras and run the whole suite on 2 workers.
# pytest's exit code 5 (no test collected) is a failure here, like any other non-zero code.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 || exit 1
python3 -m pip install -q -e '.[test]' || exit 1
python3 -m pytest -n 2 -q "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing the run" >&2
fi
exit "$status"
