#!/bin/sh
# apt-get install PACKAGE... without letting the packages start their services now (for the test tools:
# Debian's prometheus package would start a system Prometheus on :9090, nginx one on :80). A policy-rc.d already present
# (containers have one) is left as it is; otherwise one that denies every start is in place for the install
# only. The packages' units stay enabled for the next boot: `systemctl disable prometheus` if unwanted
# (docs/howto/service.md).
set -eu
POLICY=/usr/sbin/policy-rc.d
if [ -e "$POLICY" ]; then
    exec apt-get install -y -qq --no-install-recommends "$@"
fi
printf '#!/bin/sh\nexit 101\n' > "$POLICY"
chmod 755 "$POLICY"
rc=0
apt-get install -y -qq --no-install-recommends "$@" || rc=$?
rm -f "$POLICY"
exit $rc
