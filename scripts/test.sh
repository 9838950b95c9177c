#!/usr/bin/env bash
# The test command: sets up .venv (pinned torch etc.) on first use, then runs pytest.
# Extra arguments go to pytest. pytest's "no tests ran" (exit 5) fails like any other error.
# The suite runs in one pytest process per CPU core (pytest-xdist), each test file whole in one
# of them (its module fixtures, such as a ComfyUI server, start once): many tests wait on
# subprocesses and timeouts, so two processes on two cores finish well before one. `-n 0` runs
# it in this process alone.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -n auto --dist loadfile "$@"
