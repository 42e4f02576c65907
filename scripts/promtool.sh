#!/usr/bin/env bash
# Installs (once) promtool, which checks and unit-tests the Prometheus rules in
# ops/prometheus/, and prints its path on the last line.
#
#   scripts/promtool.sh               # -> /usr/bin/promtool
#
# promtool comes with Debian's `prometheus` package (apt-get, as root; the package's own service
# is not started). Idempotent: nothing is installed when `promtool` is already on PATH.
set -euo pipefail

if p=$(command -v promtool); then
    echo "$p"
    exit 0
fi
command -v apt-get >/dev/null || { echo "promtool is missing and there is no apt-get to install it (Debian's 'prometheus' package ships it)" >&2; exit 1; }
SUDO=
[ "$(id -u)" = 0 ] || SUDO=sudo
echo "installing Debian's prometheus package for promtool" >&2
$SUDO apt-get update -qq >&2
# policy-rc.d 101: the package's post-install must not start a Prometheus server.
export DEBIAN_FRONTEND=noninteractive
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod +x "$POLICY"
    trap '$SUDO rm -f "$POLICY"' EXIT
fi
$SUDO apt-get install -y -qq --no-install-recommends prometheus >&2
p=$(command -v promtool) || { echo "the prometheus package installed no promtool" >&2; exit 1; }
"$p" --version >&2
echo "$p"
