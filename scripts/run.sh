#!/usr/bin/env bash
# The main command: sets up .venv on first use, then runs the seedvr2 CLI with the arguments.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$VENV/bin/seedvr2" "$@"
