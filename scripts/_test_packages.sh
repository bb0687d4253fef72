# Sourced by scripts/test only (never by the demo): the system packages some tests need. The
# network lab (scripts/netlab.py, tests/system/test_netlab.py) needs ip and tc (iproute2); firewall tests
# need iptables; the dashboard's browser test (tests/system/test_dashboard.py) needs Debian's chromium. As
# root (CI runs ./scripts/test as root), install what is missing once per .venv (a failed try is
# not repeated at every run: an offline machine would wait out apt's timeouts each time); never
# fail the set-up over it: without them those tests skip with the reason.
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
