#!/usr/bin/env bash
# Set up a development environment in .venv (idempotent): the system libjpeg-turbo for jpeg4py
# where we may install it, then dsc with its test tools. dsc itself works the same without the
# system library (simplejpeg's wheels bundle libjpeg-turbo); the tests compare the two.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ldconfig -p 2>/dev/null | grep -q libturbojpeg.so.0; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libturbojpeg0 >/dev/null) \
      || echo "setup: could not install libturbojpeg0; dsc will decode JPEGs with simplejpeg" >&2
  else
    echo "setup: libturbojpeg.so.0 missing and apt-get unavailable; dsc will decode JPEGs with simplejpeg" >&2
  fi
fi
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
