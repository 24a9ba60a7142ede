#!/usr/bin/env bash
# A throwaway Ceph radosgw for tests: one mon, one memstore OSD, one radosgw, all on 127.0.0.1,
# all state under DIR. See /work/shared/notes/s3-test-server.md for why each setting exists.
#
#   scripts/rgw.sh start DIR   # prints (and writes DIR/env) BATON_S3_ENDPOINT, AWS_* lines
#   scripts/rgw.sh stop DIR    # SIGKILLs the recorded daemons and removes DIR
#
# Environment:
#   RGW_START_TIMEOUT   seconds before start gives up (default 60)
#   RGW_MEMSTORE_BYTES  OSD capacity; RAM is only used for what is stored (default 16 GiB)
#   RGW_WATCH_PID       if set, a watchdog stops the cluster once that process is gone, so a
#                       test runner killed with SIGKILL does not leak daemons or the directory
#
# Invariants: `stop` only kills pids whose command line names DIR (a stale pid file never kills
# a stranger), and only removes DIR if `start` created its marker file (a typo never rm -rf's a
# home directory). A failed start kills what it started and leaves DIR for the logs.
set -euo pipefail

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
MARKER=.baton-rgw

die() { echo "rgw.sh: $*" >&2; exit 1; }

usage() {
  echo "usage: $0 start DIR | stop DIR" >&2
  exit 2
}

now_ms() { date +%s%3N; }

# RGW_TRACE=1 prints how long each step took (for tuning start time).
trace() { [[ -z "${RGW_TRACE:-}" ]] || echo "rgw.sh: +$(( $(now_ms) - T0 )) ms $*" >&2; }

# A random loopback port below the kernel's ephemeral range (32768+), so it does not collide
# with outgoing connections; skip ports something already listens on. Binding can still race
# with another process: callers retry on bind failure.
pick_port() {
  local p
  for _ in $(seq 1 50); do
    p=$((20000 + RANDOM % 12000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      echo "$p"
      return 0
    fi
  done
  die "no free loopback port found"
}

# --- start -----------------------------------------------------------------------------------

DIR=""
PIDS_STARTED=()

log_tail() {
  local f
  for f in "$@"; do
    [[ -s "$f" ]] || continue
    echo "---- tail of $f ----" >&2
    tail -n 25 "$f" >&2
  done
}

fail() {
  local msg="$1"; shift
  echo "rgw.sh: start failed: $msg" >&2
  log_tail "$@"
  local pid
  for pid in "${PIDS_STARTED[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  echo "rgw.sh: state left in $DIR for inspection; remove it with: $0 stop $DIR" >&2
  exit 1
}

check_deadline() {
  (( $(now_ms) < DEADLINE_MS )) || fail "$1 did not happen within ${TIMEOUT}s" "${@:2}"
}

# $1 name, $2 log, rest: command. Records the pid; daemons get their own session so a Ctrl-C
# or a signal to the caller's process group does not half-kill the cluster (stop does it).
spawn() {
  local name="$1" out="$2"; shift 2
  setsid "$@" </dev/null >>"$out" 2>&1 &
  local pid=$!
  PIDS_STARTED+=("$pid")
  echo "$name $pid" >>"$DIR/pids"
}

# True when process $1 holds the socket listening on 127.0.0.1:$2. Connecting is not enough:
# a port-picking race can leave another process (another test's radosgw) answering there.
owns_listen() {
  local inode
  inode=$(awk -v p="$(printf '0100007F:%04X' "$2")" '$2 == p && $4 == "0A" { print $10; exit }' /proc/net/tcp 2>/dev/null)
  [[ -n "$inode" ]] && ls -l "/proc/$1/fd" 2>/dev/null | grep -qF "socket:[$inode]"
}

alive() { kill -0 "$1" 2>/dev/null && [[ "$(cat "/proc/$1/stat" 2>/dev/null | awk '{print $3}')" != Z ]]; }

write_conf() {
  cat >"$CONF" <<EOF
[global]
fsid = $FSID
mon_host = v2:127.0.0.1:$MON_PORT
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_ipv6 = false
ms_bind_msgr1 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
keyring = /dev/null
run_dir = $DIR/run
admin_socket = $DIR/run/\$name.asok
log_file = $DIR/log/\$name.log
crash_dir = $DIR/crash
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
osd_crush_chooseleaf_type = 0
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_op_num_shards = 2
osd_op_num_threads_per_shard = 1
ms_async_op_threads = 2

[mon]
mon_data = $DIR/mon/\$cluster-\$id
paxos_propose_interval = 0.01
paxos_min_wait = 0.01

[osd]
osd_data = $DIR/osd/\$cluster-\$id
osd_objectstore = memstore
memstore_device_bytes = ${RGW_MEMSTORE_BYTES:-17179869184}

[client]
ms_mon_client_mode = crc
rgw_frontends = beast endpoint=127.0.0.1:$RGW_PORT tcp_nodelay=1
rgw_data = $DIR/rgw/\$cluster-\$id
rgw_dynamic_resharding = false
rgw_gc_obj_min_wait = 10
rgw_gc_processor_period = 15
EOF
}

# Starts the mon on a fresh port; retries with another port if the bind raced.
start_mon() {
  local try
  for try in 1 2 3; do
    if (( try > 1 )); then
      MON_PORT=$(pick_port)
      while [[ "$RGW_PORT" == "$MON_PORT" ]]; do MON_PORT=$(pick_port); done
      write_conf
      mv -f "$DIR/log/mon.a.log" "$DIR/log/mon.a.log.try$((try - 1))" 2>/dev/null || true
    fi
    rm -rf "$DIR/mon" "$DIR/monmap"
    mkdir -p "$DIR/mon"
    monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MON_PORT]" "$DIR/monmap" \
      >>"$DIR/log/setup.out" 2>&1 || fail "monmaptool failed" "$DIR/log/setup.out"
    ceph-mon -c "$CONF" --mkfs -i a --monmap "$DIR/monmap" >>"$DIR/log/setup.out" 2>&1 \
      || fail "ceph-mon --mkfs failed" "$DIR/log/setup.out" "$DIR/log/mon.a.log"
    spawn mon "$DIR/log/mon.out" ceph-mon -c "$CONF" -i a -f
    MON_PID=${PIDS_STARTED[-1]}
    # The mon is up once it listens on its port; if another process got the port first, the
    # mon logs the bind failure (and would retry for 10 s): kill it and try another port.
    until owns_listen "$MON_PID" "$MON_PORT"; do
      if grep -q "unable to bind" "$DIR/log/mon.a.log" 2>/dev/null; then
        kill -9 "$MON_PID" 2>/dev/null || true
        wait "$MON_PID" 2>/dev/null || true
        echo "rgw.sh: mon port $MON_PORT was taken, retrying with another" >&2
        continue 2
      fi
      alive "$MON_PID" || fail "ceph-mon exited" "$DIR/log/mon.out" "$DIR/log/mon.a.log"
      check_deadline "ceph-mon listening on 127.0.0.1:$MON_PORT" "$DIR/log/mon.out" "$DIR/log/mon.a.log"
      sleep 0.02
    done
    return 0
  done
  fail "ceph-mon could not bind a port after 3 tries" "$DIR/log/mon.out" "$DIR/log/mon.a.log"
}

cmd_start() {
  [[ -n "$DIR" ]] || usage
  T0=$(now_ms)
  TIMEOUT=${RGW_START_TIMEOUT:-60}
  DEADLINE_MS=$((T0 + TIMEOUT * 1000))

  local b
  for b in ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool uuidgen curl setsid; do
    command -v "$b" >/dev/null || die "$b not found: install radosgw ceph-mon ceph-osd ceph-common uuid-runtime curl (scripts/install-deps.sh)"
  done

  mkdir -p "$DIR"
  DIR="$(cd "$DIR" && pwd)"
  if [[ -n "$(ls -A "$DIR")" ]]; then
    die "$DIR is not empty: give start a new or empty directory"
  fi
  touch "$DIR/$MARKER"
  mkdir -p "$DIR/run" "$DIR/log" "$DIR/crash" "$DIR/osd/ceph-0" "$DIR/rgw"
  : >"$DIR/pids"
  CONF="$DIR/ceph.conf"
  FSID=$(uuidgen)
  local osd_uuid; osd_uuid=$(uuidgen)
  MON_PORT=$(pick_port)
  RGW_PORT=$(pick_port)
  while [[ "$RGW_PORT" == "$MON_PORT" ]]; do RGW_PORT=$(pick_port); done
  write_conf

  # The OSD's mkfs needs no mon (--no-mon-config: only fsid and osd_data, which a mon port
  # retry does not change), so it runs while the mon starts; `osd new` below needs the mon.
  ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$osd_uuid" --no-mon-config >>"$DIR/log/osd-mkfs.out" 2>&1 &
  local mkfs_pid=$!
  start_mon
  trace "mon listening"

  local id
  id=$(ceph -c "$CONF" --connect-timeout "$TIMEOUT" osd new "$osd_uuid" 2>>"$DIR/log/setup.out") \
    || fail "ceph osd new failed" "$DIR/log/setup.out" "$DIR/log/mon.a.log"
  [[ "$id" == 0 ]] || fail "ceph osd new returned '$id', expected 0" "$DIR/log/setup.out"
  wait "$mkfs_pid" || fail "ceph-osd --mkfs failed" "$DIR/log/osd-mkfs.out" "$DIR/log/osd.0.log"
  trace "osd mkfs + osd new"
  spawn osd "$DIR/log/osd.out" ceph-osd -c "$CONF" -i 0 -f
  local osd_pid=${PIDS_STARTED[-1]}

  # radosgw started before the OSD is up waits for a 5 s objecter tick on its first pool ops.
  # The OSD logs "state: booting -> active" (at the default debug_osd 1) once the mon has
  # marked it up; reading the log is ~300 ms faster per poll than the python `ceph` CLI.
  until grep -q "state: booting -> active" "$DIR/log/osd.0.log" 2>/dev/null; do
    alive "$osd_pid" || fail "ceph-osd exited" "$DIR/log/osd.out" "$DIR/log/osd.0.log"
    check_deadline "the OSD coming up" "$DIR/log/osd.out" "$DIR/log/osd.0.log" "$DIR/log/mon.a.log"
    sleep 0.05
  done

  trace "osd up"
  # The user is created before radosgw starts: radosgw-admin notifies every radosgw watching
  # the cluster, and a radosgw that died (port race, below) holds its watch for 30 s.
  local ak sk
  ak="BATON$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n' | tr 'a-f' 'A-F')"
  sk="$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')"
  radosgw-admin -c "$CONF" -n client.admin user create --uid=test --display-name=test \
    --access-key="$ak" --secret-key="$sk" >>"$DIR/log/setup.out" 2>&1 \
    || fail "radosgw-admin user create failed" "$DIR/log/setup.out" "$DIR/log/client.admin.log"

  trace "user created"
  local try rgw_pid="" code
  for try in 1 2 3; do
    # Picked right before use: the window in which another process can take it is short.
    RGW_PORT=$(pick_port)
    while [[ "$RGW_PORT" == "$MON_PORT" ]]; do RGW_PORT=$(pick_port); done
    sed -i "s|^rgw_frontends = .*|rgw_frontends = beast endpoint=127.0.0.1:$RGW_PORT tcp_nodelay=1|" "$CONF"
    spawn rgw "$DIR/log/rgw.out" radosgw -c "$CONF" -n client.rgw.a -f
    rgw_pid=${PIDS_STARTED[-1]}
    while true; do
      if owns_listen "$rgw_pid" "$RGW_PORT"; then
        code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$RGW_PORT/" 2>/dev/null) || true
        [[ "$code" == 200 ]] && break 2
      fi
      if ! alive "$rgw_pid"; then
        # radosgw exits (status 98) when its port is taken.
        if grep -q "failed to bind address" "$DIR/log/client.rgw.a.log" 2>/dev/null; then
          mv -f "$DIR/log/client.rgw.a.log" "$DIR/log/client.rgw.a.log.try$try"
          echo "rgw.sh: radosgw port $RGW_PORT was taken, retrying with another" >&2
          continue 2
        fi
        fail "radosgw exited" "$DIR/log/rgw.out" "$DIR/log/client.rgw.a.log"
      fi
      check_deadline "radosgw answering GET / on 127.0.0.1:$RGW_PORT" "$DIR/log/rgw.out" "$DIR/log/client.rgw.a.log" "$DIR/log/osd.0.log"
      sleep 0.02
    done
  done
  [[ "$code" == 200 ]] || fail "radosgw could not bind a port after 3 tries" "$DIR/log/rgw.out" "$DIR/log/client.rgw.a.log"

  trace "rgw answering"
  # The user is visible to radosgw once a signed ListBuckets succeeds.
  until curl -sf -o /dev/null --max-time 2 --aws-sigv4 "aws:amz:us-east-1:s3" --user "$ak:$sk" \
      -H 'x-amz-content-sha256: UNSIGNED-PAYLOAD' "http://127.0.0.1:$RGW_PORT/"; do
    alive "$rgw_pid" || fail "radosgw exited" "$DIR/log/rgw.out" "$DIR/log/client.rgw.a.log"
    check_deadline "a signed request succeeding" "$DIR/log/client.rgw.a.log"
    sleep 0.05
  done

  if [[ -n "${RGW_WATCH_PID:-}" ]]; then
    # exec: the watchdog's pid is the one recorded, and `stop` run by it skips itself ($$).
    setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; exec "$0" stop "$2"' \
      "$SELF" "$RGW_WATCH_PID" "$DIR" </dev/null >/dev/null 2>&1 &
    echo "watchdog $!" >>"$DIR/pids"
  fi

  cat >"$DIR/env" <<EOF
BATON_S3_ENDPOINT=http://127.0.0.1:$RGW_PORT
AWS_ACCESS_KEY_ID=$ak
AWS_SECRET_ACCESS_KEY=$sk
AWS_REGION=us-east-1
EOF
  cat "$DIR/env"
  echo "rgw.sh: radosgw ready on 127.0.0.1:$RGW_PORT in $(( $(now_ms) - T0 )) ms (state in $DIR)" >&2
}

# --- stop ------------------------------------------------------------------------------------

cmd_stop() {
  [[ -n "$DIR" ]] || usage
  [[ -d "$DIR" ]] || return 0
  DIR="$(cd "$DIR" && pwd)"
  [[ -f "$DIR/$MARKER" ]] || die "$DIR was not created by '$0 start' (no $MARKER): not touching it"
  local name pid victims=()
  if [[ -f "$DIR/pids" ]]; then
    while read -r name pid; do
      [[ "$pid" =~ ^[0-9]+$ ]] || continue
      [[ "$pid" == "$$" ]] && continue
      # Only a process whose command line names DIR is ours; a recycled pid is left alone.
      if tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF -- "$DIR"; then
        kill -9 "$pid" 2>/dev/null || true
        victims+=("$pid")
      fi
    done <"$DIR/pids"
  fi
  # SIGKILL is asynchronous; wait so the ports and files are free when stop returns.
  for pid in "${victims[@]}"; do
    for _ in $(seq 1 250); do
      [[ -d "/proc/$pid" ]] && [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]] || break
      sleep 0.02
    done
  done
  rm -rf "$DIR"
}

[[ $# -eq 2 ]] || usage
DIR="$2"
case "$1" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  *) usage ;;
esac
