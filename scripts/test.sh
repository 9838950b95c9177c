#!/usr/bin/env bash
# The test command: sets up .venv (pinned torch etc.) on first use, then runs pytest.
# Extra arguments go to pytest. pytest's "no tests ran" (exit 5) fails like any other error.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
