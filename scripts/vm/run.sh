#!/usr/bin/env bash
# scripts/vm/run.sh — runs one kernel-NBD scenario in a qemu VM against an NBD server that is
# already listening on a Unix socket, and judges the result.
#
#   run.sh --socket PATH --export NAME --conns N --mode netlink|ioctl --scenario ext4|readonly
#          --out RESULTFILE [--timeout SECS] [--nbd-timeout SECS] [--console FILE] [--vm-dir DIR]
#          [--no-build] [--tls-dir DIR]
#
# Owns: the qemu process (never outlives this script: wall-clock timeout, and killed on
# TERM/INT/EXIT), RESULTFILE (the guest's step lines, see build.sh) and the console log
# (default RESULTFILE.console). The VM image comes from build.sh in --vm-dir (default
# $BATON_VM_CACHE or /var/cache/baton-vm); build.sh returns quickly when it is up to date
# (~1.5 s: one apt-cache lookup), and --no-build skips even that (the caller already built).
# Debug knobs: BATON_VM_APPEND (extra kernel arguments), BATON_VM_CPU, BATON_VM_SMP.
# --tls-dir DIR: the guest attaches over TLS with DIR's ca-cert.pem, client-cert.pem and
# client-key.pem (libnbd's client layout). They reach the guest as /tls/ in a second cpio
# archive appended to a copy of the initramfs (RESULTFILE.initrd, removed at the end): the
# kernel unpacks concatenated archives, so the cached image stays the same for every run.
#
# Exit status: 0 only if RESULTFILE ends with "done" and has no "fail" line; 1 scenario failed;
# 2 usage; 3 VM image unavailable; 124 wall-clock timeout (qemu killed).
#
# The VM has no network (-nic none): each NBD connection is a virtio-serial port whose qemu
# chardev connects to PATH. qemu opens all N connections when it starts, ~3 s before the guest
# uses them, so the server must already listen and must tolerate a silent handshake for a while.
set -euo pipefail

usage() { sed -n '5,7p' "$0" | sed 's/^# *//' >&2; exit 2; }
SOCKET="" EXPORT="" CONNS=1 MODE=netlink SCENARIO=ext4 OUT="" TIMEOUT=120 NBD_TIMEOUT=30 CONSOLE="" BUILD=1 TLSDIR=
VMDIR=${BATON_VM_CACHE:-/var/cache/baton-vm}
while [ $# -gt 0 ]; do
  case $1 in
    --socket) SOCKET=$2 ;;
    --export) EXPORT=$2 ;;
    --conns) CONNS=$2 ;;
    --mode) MODE=$2 ;;
    --scenario) SCENARIO=$2 ;;
    --out) OUT=$2 ;;
    --timeout) TIMEOUT=$2 ;;
    --nbd-timeout) NBD_TIMEOUT=$2 ;;
    --console) CONSOLE=$2 ;;
    --vm-dir) VMDIR=$2 ;;
    --tls-dir) TLSDIR=$2 ;;
    --no-build) BUILD=0; shift; continue ;;
    -h|--help) usage ;;
    *) echo "run.sh: unknown argument $1" >&2; usage ;;
  esac
  shift 2 || usage
done
[ -n "$SOCKET" ] && [ -n "$OUT" ] || usage
[ -S "$SOCKET" ] || { echo "run.sh: $SOCKET is not a listening Unix socket" >&2; exit 2; }
[[ $CONNS =~ ^[1-4]$ ]] || { echo "run.sh: --conns must be 1..4 (nbds_max and ports)" >&2; exit 2; }
[[ $MODE == netlink || $MODE == ioctl ]] || usage
[[ $SCENARIO =~ ^[a-z0-9]+$ ]] || usage
[[ $TIMEOUT =~ ^[0-9]+$ && $NBD_TIMEOUT =~ ^[0-9]+$ ]] || usage
# The export name travels on the kernel command line: no spaces or quotes.
[[ $EXPORT =~ ^[A-Za-z0-9._/:@+-]*$ ]] || { echo "run.sh: export name must match [A-Za-z0-9._/:@+-]*" >&2; exit 2; }
CONSOLE=${CONSOLE:-$OUT.console}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ "$BUILD" = 1 ]; then
  bash "$HERE/build.sh" "$VMDIR" >&2 || { echo "run.sh: VM image unavailable" >&2; exit 3; }
fi
[ -s "$VMDIR/vmlinux" ] && [ -s "$VMDIR/initrd.cpio" ] || { echo "run.sh: no VM image in $VMDIR (run build.sh)" >&2; exit 3; }
command -v qemu-system-x86_64 >/dev/null || { echo "run.sh: qemu-system-x86_64 missing" >&2; exit 3; }

# qemu's socket chardev takes the path verbatim; commas would split its option string.
[[ $SOCKET != *,* && $OUT != *,* && $CONSOLE != *,* ]] || { echo "run.sh: paths must not contain commas" >&2; exit 2; }
: >"$OUT"
: >"$CONSOLE"

INITRD=$VMDIR/initrd.cpio
if [ -n "$TLSDIR" ]; then
  for f in ca-cert.pem client-cert.pem client-key.pem; do
    [ -r "$TLSDIR/$f" ] || { echo "run.sh: --tls-dir $TLSDIR has no readable $f" >&2; exit 2; }
  done
  command -v cpio >/dev/null || { echo "run.sh: cpio missing" >&2; exit 3; }
  stage=$(mktemp -d)
  mkdir "$stage/tls"
  cp "$TLSDIR/ca-cert.pem" "$TLSDIR/client-cert.pem" "$TLSDIR/client-key.pem" "$stage/tls/"
  INITRD=$OUT.initrd
  { cat "$VMDIR/initrd.cpio"; (cd "$stage" && find . | sort | cpio -o -H newc --quiet -R 0:0); } >"$INITRD"
  rm -rf "$stage"
fi

args=(
  -nodefaults -nic none -display none -no-reboot
  # Hardware KVM does not work on these hosts (kvm_pvm): software emulation. One vCPU: with
  # two, NBD reads through virtio-serial ran 3-5x slower on a 2-core host (cross-vCPU IPIs
  # under TCG), and the host's second core stays free for the NBD server.
  -accel tcg,thread=multi -cpu "${BATON_VM_CPU:-max}" -smp "${BATON_VM_SMP:-1}" -m 512M
  # PVH boot of the uncompressed ELF + uncompressed cpio: no decompression under TCG.
  -kernel "$VMDIR/vmlinux" -initrd "$INITRD"
  # Boot-time trims, each worth a little under TCG (found with initcall_debug): no crypto
  # self-tests (the KDF one ignores cryptomgr.notests: ~0.5 s), no kprobe-event setup, no
  # speculation mitigations (the guest runs only our tools), no TSC recalibration/watchdog,
  # expedited RCU, no PS/2 or extra UART probing.
  -append "console=ttyS0 quiet panic=-1 rdinit=/init cryptomgr.notests initcall_blacklist=crypto_kdf108_init,init_kprobe_trace mitigations=off tsc=reliable no_timer_check rcupdate.rcu_expedited=1 i8042.noaux i8042.nokbd i8042.nopnp 8250.nr_uarts=1 baton.scenario=$SCENARIO baton.conns=$CONNS baton.netlink=$([ "$MODE" = netlink ] && echo 1 || echo 0) baton.export=$EXPORT baton.timeout=$NBD_TIMEOUT baton.tls=$([ -n "$TLSDIR" ] && echo 1 || echo 0) ${BATON_VM_APPEND:-}"
  -serial "file:$CONSOLE"
  -device virtio-serial-pci,id=vs0,max_ports=$((CONNS + 2))
  # Results on their own port: kernel messages reach the console even with "quiet".
  -chardev "file,id=result,path=$OUT"
  -device virtserialport,bus=vs0.0,nr=1,chardev=result,name=baton.result
)
for ((i = 0; i < CONNS; i++)); do
  args+=(-chardev "socket,id=nbd$i,path=$SOCKET"
         -device "virtserialport,bus=vs0.0,nr=$((i + 2)),chardev=nbd$i,name=baton.nbd$i")
done

start=$(date +%s%N)
# timeout(1) bounds the run even if this script is SIGKILLed; the trap covers TERM/INT.
# --foreground keeps qemu in this script's process group, so a caller that kills the group
# (test/helpers/vm.ts does at exit) kills qemu too.
timeout --foreground -k 5 "$TIMEOUT" qemu-system-x86_64 "${args[@]}" </dev/null &
qpid=$!
trap 'kill -TERM "$qpid" 2>/dev/null; wait "$qpid" 2>/dev/null; [ -z "$TLSDIR" ] || rm -f "$OUT.initrd"' EXIT
trap 'exit 143' TERM INT
set +e
wait "$qpid"; qrc=$?
set -e
trap - EXIT
[ -z "$TLSDIR" ] || rm -f "$OUT.initrd"
elapsed=$((($(date +%s%N) - start) / 1000000))

cat "$OUT"
if [ "$qrc" -eq 124 ] || [ "$qrc" -eq 137 ]; then
  echo "run.sh: wall-clock timeout after ${TIMEOUT}s: qemu killed (console: $CONSOLE)" >&2
  tail -n 20 "$CONSOLE" >&2
  exit 124
fi
last=$(grep -v '^[[:space:]]*$' "$OUT" | tail -n 1 || true)
if [ "$last" = done ] && ! grep -q '^fail' "$OUT"; then
  echo "run.sh: $SCENARIO conns=$CONNS mode=$MODE passed in ${elapsed}ms" >&2
  exit 0
fi
echo "run.sh: $SCENARIO conns=$CONNS mode=$MODE FAILED after ${elapsed}ms (qemu rc=$qrc, console: $CONSOLE)" >&2
tail -n 20 "$CONSOLE" >&2
exit 1
