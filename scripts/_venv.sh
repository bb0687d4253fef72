# Sourced by scripts/demo and scripts/test: create or reuse .venv with swarmd, its test and plot extras
# and a CPU build of torch. Reinstalls only when setup.cfg or pyproject.toml changed.
# Override the interpreter with PYTHON=python3.12, the torch requirement with SWARMD_TORCH.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
# torch is pinned here (not in setup.cfg, which keeps a range for users with GPUs): an unpinned
# torch can pull a multi-GB CUDA build on a CPU-only machine.
SWARMD_TORCH="${SWARMD_TORCH:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "swarmd needs Python >= 3.10"' ||
        { echo "swarmd: error: $PYTHON is older than 3.10; set PYTHON=python3.x" >&2; exit 2; }
    echo "setting up .venv with $("$PYTHON" --version)" >&2
    "$PYTHON" -m venv .venv
fi
stamp=".venv/.swarmd-installed"
want="$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16) $SWARMD_TORCH test,plot"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing swarmd and its dependencies into .venv (first run only; log: .venv/install.log)" >&2
    {
        .venv/bin/python -m pip install --disable-pip-version-check "$SWARMD_TORCH" &&
        .venv/bin/python -m pip install --disable-pip-version-check -e '.[test,plot]'
    } > .venv/install.log 2>&1 ||
        { tail -n 30 .venv/install.log >&2; echo "swarmd: error: installing into .venv failed; see .venv/install.log" >&2; exit 1; }
    echo "$want" > "$stamp"
fi
# The network lab (scripts/netlab.py, tests/test_netlab.py) needs ip and tc (iproute2); firewall tests
# need iptables; the dashboard's browser test (tests/test_dashboard.py) needs Debian's chromium. As root,
# install what is missing once per .venv (a failed try is not repeated at every run: an offline machine
# would wait out apt's timeouts each time); never fail the set-up over it: without them those tests skip
# with the reason.
netlab_stamp=".venv/.swarmd-netlab-packages"
if [ "$(id -u)" = 0 ] && [ ! -e "$netlab_stamp" ] && command -v apt-get > /dev/null &&
    ! { command -v ip && command -v tc && command -v iptables && command -v chromium; } > /dev/null 2>&1; then
    echo "installing iproute2, iptables and chromium for the network lab and the dashboard test (log: .venv/netlab-apt.log)" >&2
    {
        timeout 300 apt-get update -q &&
        DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends iproute2 iptables chromium
    } > .venv/netlab-apt.log 2>&1 ||
        echo "swarmd: warning: could not install iproute2/iptables/chromium (see .venv/netlab-apt.log); the lab's and the dashboard's browser tests will skip; delete $netlab_stamp to try again" >&2
    touch "$netlab_stamp"
fi
