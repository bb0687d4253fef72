# Sourced by scripts/demo, scripts/test and scripts/lint: create or reuse .venv with swarmd, the
# extras the caller names in SWARMD_EXTRAS (default: test,plot; the demo asks for plot alone) and
# a CPU build of torch. Reinstalls only when setup.cfg or pyproject.toml changed, or when an extra
# is asked for that is not installed yet (extras once installed stay, so demo and test never undo
# each other's set-up). Override the interpreter with PYTHON=python3.12, the torch requirement
# with SWARMD_TORCH. Nothing here installs system packages: the tests' are in _test_packages.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
# torch is pinned here (not in setup.cfg, which keeps a range for users with GPUs): an unpinned
# torch can pull a multi-GB CUDA build on a CPU-only machine.
SWARMD_TORCH="${SWARMD_TORCH:-torch==2.13.0}"
SWARMD_EXTRAS="${SWARMD_EXTRAS:-test,plot}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "swarmd needs Python >= 3.10"' ||
        { echo "swarmd: error: $PYTHON is older than 3.10; set PYTHON=python3.x" >&2; exit 2; }
    echo "setting up .venv with $("$PYTHON" --version)" >&2
    "$PYTHON" -m venv .venv
fi
stamp=".venv/.swarmd-installed"
base="$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16) $SWARMD_TORCH"
stamp_hash="" stamp_torch="" stamp_extras=""
[ -e "$stamp" ] && { read -r stamp_hash stamp_torch stamp_extras < "$stamp" || true; }
sorted() { printf '%s\n' ${1//,/ } | sort -u | paste -sd, -; }
installed=""  # the extras installed for this setup.cfg and torch, sorted ("" when anything changed)
[ "$stamp_hash $stamp_torch" = "$base" ] && installed="$(sorted "$stamp_extras")"
extras="$(sorted "$installed,$SWARMD_EXTRAS")"  # those, and those asked for
if [ "$extras" != "$installed" ]; then
    echo "installing swarmd and its dependencies into .venv (first run only; log: .venv/install.log)" >&2
    {
        .venv/bin/python -m pip install --disable-pip-version-check "$SWARMD_TORCH" &&
        .venv/bin/python -m pip install --disable-pip-version-check -e ".[$extras]"
    } > .venv/install.log 2>&1 ||
        { tail -n 30 .venv/install.log >&2; echo "swarmd: error: installing into .venv failed; see .venv/install.log" >&2; exit 1; }
    echo "$base $extras" > "$stamp"
fi
