# Sourced by scripts/test.sh and scripts/run.sh: makes .venv with the pinned test environment
# and this package installed editable. Re-installs only when a requirements file changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SEEDVR2_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.seedvr2-installed"
want="$(cat "$ROOT/requirements-test.txt" "$ROOT/requirements.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements-test.txt" -r "$ROOT/requirements.txt"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT"
  echo "$want" > "$stamp"
fi
