#!/usr/bin/env bash
# Ceph's radosgw as a throwaway S3 endpoint on loopback, for one command: a one-node cluster (one
# monitor, one OSD on memstore, radosgw's beast frontend on 127.0.0.1) started from Debian's
# packages, COMMAND run with its address and credentials in the environment, torn down at the end.
#
#   scripts/radosgw_serve.sh COMMAND [ARGS...]
#
# COMMAND sees DSC_TEST_S3_ENDPOINT (http://127.0.0.1:PORT), DSC_TEST_S3_ACCESS_KEY_ID,
# DSC_TEST_S3_SECRET_ACCESS_KEY and DSC_TEST_S3_REGION (what tests/s3server.py reads), and
# DSC_TEST_S3_SERVER_PIDS (the monitor's, OSD's and radosgw's process ids: a benchmark's CPU
# accounting); the script exits with COMMAND's status. scripts/radosgw_s3_tests.sh runs the
# object-storage tests this way; the benchmark, e.g.:
#   scripts/radosgw_serve.sh sh -c 'AWS_ACCESS_KEY_ID=$DSC_TEST_S3_ACCESS_KEY_ID \
#     AWS_SECRET_ACCESS_KEY=$DSC_TEST_S3_SECRET_ACCESS_KEY .venv/bin/python benchmarks/s3_read_bench.py \
#     --endpoint $DSC_TEST_S3_ENDPOINT --server-pids $DSC_TEST_S3_SERVER_PIDS'
#
# Needs the packages radosgw, ceph-mon and ceph-osd (installed with apt-get when run as root and
# they are missing) and .venv from scripts/setup.sh. Everything lives in a temporary folder; only
# the daemons this script started are stopped (by their process ids). Messenger v2 in crc mode
# (`ms client mode = crc`, `ms mon client mode = crc`): without them clients hang at
# authentication for 300 s. Beast with `tcp_nodelay=1`: without it every small answer (a HEAD, a
# manifest, an error) waits ~40 ms on loopback (Nagle's algorithm holding the body until the client's
# delayed ACK of the headers): 42 ms -> 1.3 ms a small GET here. No manager daemon: radosgw does
# not need one. The OSD keeps its objects in memory: RADOSGW_MEMSTORE_BYTES (default 1 GiB) bounds
# them. KEEP=1 keeps the folder (config, logs) after the run. Cold start to a serving radosgw:
# about 13 s here (Ceph 16.2.15 from Debian 12).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ $# -gt 0 ] || { echo "usage: scripts/radosgw_serve.sh COMMAND [ARGS...]" >&2; exit 2; }
[ -x "$PY" ] || { echo "radosgw_serve: run scripts/setup.sh first" >&2; exit 2; }

if ! command -v radosgw >/dev/null || ! command -v ceph-mon >/dev/null || ! command -v ceph-osd >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq radosgw ceph-mon ceph-osd >/dev/null
  else
    echo "radosgw_serve: needs the Debian packages radosgw ceph-mon ceph-osd" >&2; exit 2
  fi
fi

D=$(mktemp -d /tmp/dsc-radosgw.XXXXXX)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ "${KEEP:-0}" = 1 ]; then echo "radosgw_serve: kept $D"; else rm -rf "$D"; fi
}
trap cleanup EXIT

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
MON_PORT=$(free_port)
RGW_PORT=$(free_port)
FSID=$("$PY" -c 'import uuid; print(uuid.uuid4())')
CONF="$D/ceph.conf"
mkdir -p "$D/mon" "$D/osd/ceph-0" "$D/run" "$D/log"
cat >"$CONF" <<EOF
[global]
fsid = $FSID
mon host = [v2:127.0.0.1:$MON_PORT]
mon initial members = a
public network = 127.0.0.0/8
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
ms bind msgr1 = false
ms client mode = crc
ms mon client mode = crc
ms service mode = crc
ms cluster mode = crc
ms mon service mode = crc
ms mon cluster mode = crc
keyring = $D/keyring
run dir = $D/run
admin socket = $D/run/\$name.asok
log file = $D/log/\$name.log
pid file = $D/run/\$name.pid
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
[mon]
mon data = $D/mon/ceph-\$id
[osd]
osd data = $D/osd/ceph-\$id
keyring = $D/osd/ceph-\$id/keyring
osd objectstore = memstore
memstore device bytes = ${RADOSGW_MEMSTORE_BYTES:-1073741824}
osd crush update on start = true
[client.rgw.a]
keyring = $D/rgw.keyring
rgw frontends = beast endpoint=127.0.0.1:$RGW_PORT tcp_nodelay=1
rgw data = $D/rgw
EOF

began=$(date +%s)
ceph-authtool --create-keyring "$D/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool "$D/keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' \
  --cap mgr 'allow *' >/dev/null
monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MON_PORT]" "$D/monmap" >/dev/null
ceph-mon -c "$CONF" --mkfs -i a --monmap "$D/monmap" --keyring "$D/keyring"
ceph-mon -c "$CONF" -i a -f >>"$D/log/mon.out" 2>&1 & PIDS+=($!)
CEPH=(timeout 30 ceph -c "$CONF" --connect-timeout 20)
"${CEPH[@]}" -s >/dev/null

OSD_UUID=$("$PY" -c 'import uuid; print(uuid.uuid4())')
OSD_ID=$("${CEPH[@]}" osd create "$OSD_UUID")
# the same uuid on both sides, or the monitor ignores its boot ("different fsid")
ceph-osd -c "$CONF" -i "$OSD_ID" --mkfs --mkkey --osd-uuid "$OSD_UUID" --no-mon-config 2>"$D/log/osd-mkfs.err" >/dev/null
"${CEPH[@]}" auth add "osd.$OSD_ID" osd 'allow *' mon 'allow profile osd' -i "$D/osd/ceph-$OSD_ID/keyring" >/dev/null
ceph-osd -c "$CONF" -i "$OSD_ID" -f >>"$D/log/osd.out" 2>&1 & PIDS+=($!)
for _ in $(seq 60); do
  "${CEPH[@]}" osd stat 2>/dev/null | grep -q " 1 up" && break
  sleep 0.5
done
"${CEPH[@]}" osd stat | grep -q " 1 up" || { echo "radosgw_serve: the OSD did not come up (logs: $D/log)" >&2; KEEP=1; exit 1; }

"${CEPH[@]}" auth get-or-create client.rgw.a mon 'allow rw' osd 'allow rwx' >"$D/rgw.keyring"
mkdir -p "$D/rgw"
radosgw -c "$CONF" -n client.rgw.a --keyring "$D/rgw.keyring" -f >>"$D/log/rgw.out" 2>&1 & PIDS+=($!)
KEY=dsctestkey SECRET=dsctestsecret
rgw_up() {
  "$PY" - "$RGW_PORT" <<'EOF' 2>/dev/null
import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=2)
except urllib.error.HTTPError:
    pass  # any HTTP answer: it is up
EOF
}
for _ in $(seq 120); do rgw_up && break; sleep 0.5; done
rgw_up || { echo "radosgw_serve: radosgw did not answer on 127.0.0.1:$RGW_PORT (logs: $D/log)" >&2; KEEP=1; exit 1; }
timeout 60 radosgw-admin -c "$CONF" user create --uid=dsc --display-name=dsc --access-key="$KEY" --secret="$SECRET" >/dev/null
echo "radosgw_serve: radosgw on 127.0.0.1:$RGW_PORT after $(( $(date +%s) - began )) s ($D)"

export DSC_TEST_S3_ENDPOINT="http://127.0.0.1:$RGW_PORT" DSC_TEST_S3_ACCESS_KEY_ID="$KEY" \
  DSC_TEST_S3_SECRET_ACCESS_KEY="$SECRET" DSC_TEST_S3_REGION=us-east-1 DSC_TEST_S3_SERVER_PIDS="${PIDS[*]}"
"$@"
