#!/usr/bin/env bash
# scripts/vm/build.sh OUTDIR — builds the kernel + initramfs of the kernel-NBD test VM.
#
# Owns: OUTDIR/vmlinux (uncompressed ELF, booted by qemu's PVH loader), OUTDIR/initrd.cpio
# (uncompressed newc cpio), OUTDIR/stamp, and the downloaded kernel package in OUTDIR/deb/.
# Why a VM at all: the host kernel has no nbd module, so the real Linux NBD client (nbd.ko driven
# by nbd-client 3.24) can only be exercised in a guest running Debian 12's own kernel.
# Design notes and measured facts: shared/notes/kernel-nbd-vm.md.
#
# Idempotent and cached: nothing is rebuilt when OUTDIR/stamp matches the kernel package the
# archive currently resolves to, the sha256 of this script (which embeds the guest /init) and the
# versions of the guest tools copied from the host. Concurrent callers serialise on a flock.
#
# Needs: busybox-static socat nbd-client e2fsprogs cpio xz-utils (dpkg-deb, apt-get for the
# kernel .deb). Never installs a kernel package: the .deb is only downloaded and unpacked.
# Env: BATON_VM_KERNEL_DEB=/path/to/linux-image-*.deb skips the apt resolution/download.
# Exit status: 0 built or up to date; 3 the kernel package cannot be had (offline, no apt
# lists): callers may skip; 1 anything else (a real error).
set -euo pipefail
export LC_ALL=C

OUTDIR=${1:?usage: build.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
SELF=$(readlink -f "${BASH_SOURCE[0]}")
log() { echo "vm/build: $*" >&2; }
die() { log "error: $*"; exit 1; }
# Exit 3 means "the kernel cannot be had here" (offline, no apt lists): tests skip on it;
# every other failure (exit 1) is a real error.
unavailable() { log "kernel unavailable: $*"; exit 3; }

for tool in cpio xz dpkg-deb ldd sha256sum flock; do
  command -v "$tool" >/dev/null || die "missing $tool (apt-get install cpio xz-utils dpkg libc-bin util-linux)"
done

# Guest tools, copied from the host together with their shared libraries. busybox must be the
# static one (busybox-static): the initramfs has no libc for it.
BUSYBOX=$(command -v busybox || true)
[ -n "$BUSYBOX" ] || die "missing busybox (apt-get install busybox-static)"
BUSYBOX=$(readlink -f "$BUSYBOX")
! ldd "$BUSYBOX" >/dev/null 2>&1 || die "$BUSYBOX is dynamically linked: apt-get install busybox-static"
declare -A TOOL
for t in nbd-client mke2fs e2fsck socat; do
  p=$(PATH="$PATH:/sbin:/usr/sbin" command -v "$t" || true)
  [ -n "$p" ] || die "missing $t (apt-get install nbd-client e2fsprogs socat)"
  TOOL[$t]=$(readlink -f "$p")
done
[ -r /etc/mke2fs.conf ] || die "missing /etc/mke2fs.conf (e2fsprogs)"

exec 9>"$OUTDIR/.lock"
flock 9

# --- Which kernel. linux-image-amd64 is a metapackage; its dependency names the ABI package
# (linux-image-6.1.0-NN-amd64), which moves with security updates, so resolve it every time.
KDEB=${BATON_VM_KERNEL_DEB:-}
KPKG="" KVERSION=""
if [ -z "$KDEB" ]; then
  if command -v apt-cache >/dev/null; then
    # One apt-cache call (each costs ~1.3 s here): the metapackage pins its dependency,
    # "Depends: linux-image-6.1.0-57-amd64 (= 6.1.192-3)".
    resolve() {
      read -r KPKG KVERSION < <(apt-cache show --no-all-versions linux-image-amd64 2>/dev/null |
        sed -n 's/^Depends:.*\(linux-image-[0-9][^ ,]*-amd64\) (= \([^)]*\)).*/\1 \2/p' | head -n 1) || true
    }
    resolve
    # A fresh machine may have no apt lists yet: as root, fetch them once (download only;
    # nothing is installed) unless a kernel package is already cached.
    if [ -z "$KPKG" ] && [ "$(id -u)" = 0 ] && ! ls "$OUTDIR"/deb/linux-image-*-amd64_*.deb >/dev/null 2>&1; then
      log "no apt lists for linux-image-amd64: apt-get update"
      apt-get update -qq >&2 || true
      resolve
    fi
  fi
  if [ -z "$KPKG" ]; then
    # Offline or no apt lists: fall back to the newest package already downloaded.
    KDEB=$(ls -1 "$OUTDIR"/deb/linux-image-*-amd64_*.deb 2>/dev/null | sort -V | tail -n 1 || true)
    [ -n "$KDEB" ] || unavailable "cannot resolve linux-image-amd64 (run apt-get update) and no kernel .deb cached in $OUTDIR/deb"
  fi
fi
if [ -n "$KDEB" ]; then
  [ -r "$KDEB" ] || die "kernel package $KDEB not readable"
  KPKG=$(dpkg-deb -f "$KDEB" Package)
  KVERSION=$(dpkg-deb -f "$KDEB" Version)
fi

tool_versions=$(dpkg-query -W -f='${Package}=${Version} ' busybox-static nbd-client e2fsprogs socat 2>/dev/null || true)
STAMP="kernel=$KPKG=$KVERSION script=$(sha256sum "$SELF" | cut -d' ' -f1) tools=${tool_versions% }"
if [ -f "$OUTDIR/stamp" ] && [ "$(cat "$OUTDIR/stamp")" = "$STAMP" ] &&
   [ -s "$OUTDIR/vmlinux" ] && [ -s "$OUTDIR/initrd.cpio" ]; then
  log "up to date ($KPKG $KVERSION) in $OUTDIR"
  exit 0
fi

# --- Fetch the kernel .deb (install.sh-style step; download only, never install).
if [ -z "$KDEB" ]; then
  mkdir -p "$OUTDIR/deb"
  KDEB=$(ls -1 "$OUTDIR/deb/${KPKG}_${KVERSION//:/%3a}_amd64.deb" 2>/dev/null || true)
  if [ -z "$KDEB" ]; then
    log "downloading $KPKG $KVERSION"
    # (As root, apt-get warns that its _apt sandbox cannot write here; harmless.)
    dl() { (cd "$OUTDIR/deb" && apt-get download -q "$1") >"$OUTDIR/deb/download.log" 2>&1; }
    if ! dl "$KPKG=$KVERSION"; then
      # Stale lists: the archive may have dropped this version. Refresh once and retry.
      if [ "$(id -u)" = 0 ]; then log "retrying after apt-get update"; apt-get update -qq >&2 || true; fi
      dl "$KPKG" || { cat "$OUTDIR/deb/download.log" >&2; unavailable "apt-get download $KPKG failed"; }
    fi
    KDEB=$(ls -1 "$OUTDIR"/deb/"${KPKG}"_*_amd64.deb | sort -V | tail -n 1)
    KVERSION=$(dpkg-deb -f "$KDEB" Version)
    STAMP="kernel=$KPKG=$KVERSION script=${STAMP#*script=}"
    # Keep only the package we use: each is ~70 MB.
    find "$OUTDIR/deb" -name 'linux-image-*.deb' ! -path "$KDEB" -delete
  fi
fi

log "building from $(basename "$KDEB")"
WORK=$(mktemp -d "$OUTDIR/.build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
KROOT=$WORK/kernel
dpkg-deb -x "$KDEB" "$KROOT"
KVER=$(ls -1 "$KROOT/lib/modules" | head -n 1)
[ -n "$KVER" ] && [ -f "$KROOT/boot/vmlinuz-$KVER" ] || die "unexpected layout in $KDEB"

# --- vmlinux: Debian ships an XZ bzImage. qemu's PVH loader boots the uncompressed ELF
# directly (~4 s faster per boot under TCG than decompressing in the guest), so extract it
# the way the kernel's scripts/extract-vmlinux does: find the XZ stream, decompress, keep the
# first candidate that is an ELF (xz complains about the trailing data; that is expected).
vmlinux=$WORK/vmlinux
for off in $(grep -obUaP '\xfd7zXZ\x00' "$KROOT/boot/vmlinuz-$KVER" | cut -d: -f1); do
  tail -c +"$((off + 1))" "$KROOT/boot/vmlinuz-$KVER" | xz -dc >"$vmlinux" 2>/dev/null || true
  [ "$(head -c 4 "$vmlinux" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ] && break
  rm -f "$vmlinux"
done
[ -s "$vmlinux" ] || die "no XZ-compressed ELF found in vmlinuz-$KVER"

# --- initramfs tree
ROOT=$WORK/initrd
mkdir -p "$ROOT"/{bin,dev,proc,sys,run,mnt,tmp,etc,opt/bin,lib/modules/"$KVER"}
cp "$BUSYBOX" "$ROOT/bin/busybox"
for applet in $("$BUSYBOX" --list); do
  [ "$applet" = busybox ] || ln -s busybox "$ROOT/bin/$applet"
done
cp /etc/mke2fs.conf "$ROOT/etc/"

# The dynamically linked tools live in /opt/bin, not /sbin: busybox ash prefers its own applets
# (mke2fs!) over PATH, so /init always calls these by full path.
for t in "${!TOOL[@]}"; do
  cp "${TOOL[$t]}" "$ROOT/opt/bin/$t"
  ldd "${TOOL[$t]}" | awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^\//) print $i }' |
  while read -r lib; do
    [ -e "$ROOT$lib" ] || { mkdir -p "$ROOT$(dirname "$lib")"; cp -L "$lib" "$ROOT$lib"; }
  done
done

# Modules: the ones /init loads plus their dependencies, read from each .ko's .modinfo
# ("depends=" is NUL-separated there). crc32c_generic is requested through the crypto API
# (ext4/jbd2 softdep "crypto-crc32c"), so no depends= line names it: it is listed explicitly.
MODDIR=$KROOT/lib/modules/$KVER
declare -A KO
while IFS= read -r f; do n=${f##*/}; KO[${n%.ko}]=${f#"$MODDIR"/}; done < <(find "$MODDIR/kernel" -name '*.ko')
declare -A WANT
want() {
  local m=${1//-/_} d
  [ -n "${WANT[$m]:-}" ] && return
  [ -n "${KO[$m]:-}" ] || die "module $m not in $KPKG"
  WANT[$m]=1
  for d in $(tr '\0' '\n' <"$MODDIR/${KO[$m]}" | sed -n 's/^depends=//p' | tr ',' ' '); do want "$d"; done
}
for m in virtio_pci virtio_console nbd crc32c_generic ext4; do want "$m"; done
for m in "${!WANT[@]}"; do
  mkdir -p "$ROOT/lib/modules/$KVER/$(dirname "${KO[$m]}")"
  cp "$MODDIR/${KO[$m]}" "$ROOT/lib/modules/$KVER/${KO[$m]}"
done
# The .deb ships no modules.dep; busybox modprobe needs one.
"$BUSYBOX" depmod -b "$ROOT" "$KVER"
log "modules: ${!WANT[*]}"

# --- /init: the guest side of every scenario. Contract with run.sh:
#   kernel command line: baton.scenario=ext4|readonly baton.conns=N baton.netlink=0|1
#                        baton.export=NAME baton.timeout=SECS (nbd-client -t)
#                        baton.tls=0|1 (1: attach over TLS with the client certificate in
#                        /tls: ca-cert.pem, client-cert.pem, client-key.pem, which run.sh
#                        --tls-dir appends to the initramfs; the server's certificate must
#                        name localhost)
#   virtio-serial port "baton.result": one line per step, "ok STEP [detail]" or
#                        "fail STEP detail", then "done"; then the guest powers off.
#   virtio-serial ports "baton.nbd0".."baton.nbdN-1": one NBD connection each, already
#                        connected by qemu to the server's socket.
cat >"$ROOT/init" <<'INIT'
#!/bin/sh
# Guest init for baton's kernel-NBD VM (generated by scripts/vm/build.sh; edit it there).
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
exec </dev/console >/dev/console 2>&1

SCENARIO=ext4 CONNS=1 NETLINK=1 EXPORT= TIMEOUT=30 TLS=0
for w in $(cat /proc/cmdline); do
  case $w in
    baton.tls=*) TLS=${w#*=} ;;
    baton.scenario=*) SCENARIO=${w#*=} ;;
    baton.conns=*) CONNS=${w#*=} ;;
    baton.netlink=*) NETLINK=${w#*=} ;;
    baton.export=*) EXPORT=${w#*=} ;;
    baton.timeout=*) TIMEOUT=${w#*=} ;;
  esac
done

now() { awk '{ printf "%d", $1 * 1000 }' /proc/uptime; }
exec 3>/dev/null
report() { echo "$*" >&3; echo "baton: $*"; }
die_early() { echo "baton: fatal: $*"; poweroff -f; sleep 5; reboot -f; }
off() { sync; poweroff -f; sleep 5; reboot -f; }

# Load modules. crc32c is loaded through the crypto API: modprobe it before any ext4 mount.
for m in virtio_pci virtio_console crc32c_generic ext4; do modprobe $m || die_early "modprobe $m"; done
modprobe nbd nbds_max=4 || die_early "modprobe nbd"

# Ports appear asynchronously after virtio_console probes; find them by their qemu name.
port() { for d in /sys/class/virtio-ports/*; do [ "$(cat $d/name 2>/dev/null)" = "$1" ] && echo /dev/${d##*/} && return 0; done; return 1; }
i=0
while :; do
  RESULT=$(port baton.result) && [ -c "$RESULT" ] && break
  i=$((i + 1)); [ $i -gt 100 ] && die_early "no baton.result port"; sleep 0.1
done
exec 3>"$RESULT"
NBD_PORTS=
i=0
while [ $i -lt "$CONNS" ]; do
  j=0
  until p=$(port baton.nbd$i) && [ -c "$p" ]; do
    j=$((j + 1)); [ $j -gt 100 ] && { report "fail boot no port baton.nbd$i"; report done; off; }; sleep 0.1
  done
  NBD_PORTS="$NBD_PORTS $p"; i=$((i + 1))
done
report "ok boot $(uname -r) $(now)ms"

# nbd.ko needs a socket, not a character device. socat listens on a Unix socket and hands each
# accepted connection (nofork: the connection itself becomes stdin/stdout) to nbd-bridge, which
# claims the next unused port (mkdir is atomic) and copies bytes between the two.
mkdir -p /run/claims
cat >/bin/nbd-bridge <<EOF
#!/bin/sh
for p in $NBD_PORTS; do
  mkdir /run/claims/\${p##*/} 2>/dev/null && exec /opt/bin/socat -b 131072 STDIO OPEN:\$p
done
echo "nbd-bridge: more connections than ports" >&2; exit 1
EOF
chmod +x /bin/nbd-bridge
/opt/bin/socat UNIX-LISTEN:/run/nbd.sock,fork,backlog=16 EXEC:/bin/nbd-bridge,nofork &
i=0; until [ -S /run/nbd.sock ]; do i=$((i + 1)); [ $i -gt 50 ] && break; sleep 0.1; done

# step NAME CMD...: runs CMD, reports ok/fail with elapsed ms; output goes to the console and,
# abridged, into the fail line.
step() {
  name=$1; shift
  t0=$(now)
  out=$("$@" 2>&1); rc=$?
  [ -n "$out" ] && echo "$out" | sed "s/^/[$name] /"
  if [ $rc -eq 0 ]; then report "ok $name $(($(now) - t0))ms"
  else report "fail $name rc=$rc $(echo "$out" | tail -n 3 | tr '\n\t' '  ')"; fi
  return $rc
}
# expect_fail NAME CMD...: the step passes only if CMD fails (e.g. writes to a read-only export).
expect_fail() {
  name=$1; shift
  out=$("$@" 2>&1); rc=$?
  [ -n "$out" ] && echo "$out" | sed "s/^/[$name] /"
  if [ $rc -ne 0 ]; then report "ok $name expected failure rc=$rc: $(echo "$out" | head -n 1 | tr '\t' ' ')"; return 0; fi
  report "fail $name succeeded but must fail"; return 1
}

ATTACHED=
attach() {
  set -- -unix /run/nbd.sock /dev/nbd0 -b 4096 -t "$TIMEOUT" -C "$CONNS"
  [ -n "$EXPORT" ] && set -- "$@" -N "$EXPORT"
  [ "$NETLINK" = 1 ] || set -- "$@" -nonetlink
  # TLS: nbd-client negotiates STARTTLS, runs the TLS session in a helper process (GnuTLS) and
  # gives the kernel a plaintext socket to it. 3.24 rejects the short forms -A/-F/-K.
  [ "$TLS" = 1 ] && set -- "$@" -cacertfile /tls/ca-cert.pem -certfile /tls/client-cert.pem -keyfile /tls/client-key.pem -tlshostname localhost
  # In ioctl mode nbd-client leaves a daemon behind: keep it off the $(...) pipe of step().
  /opt/bin/nbd-client "$@" </dev/null >/run/nbd-client.log 2>&1; rc=$?
  cat /run/nbd-client.log
  [ $rc -eq 0 ] || return 1
  i=0; until [ "$(cat /sys/block/nbd0/size)" -gt 0 ] 2>/dev/null; do
    i=$((i + 1)); [ $i -gt 50 ] && { echo "nbd0 has no size"; return 1; }; sleep 0.1
  done
  claimed=$(ls /run/claims | wc -l)
  [ "$claimed" -eq "$CONNS" ] || { echo "expected $CONNS connections, $claimed ports in use"; return 1; }
  echo "nbd0: $(($(cat /sys/block/nbd0/size) * 512)) bytes, ro=$(cat /sys/block/nbd0/ro), connections=$claimed"
}
detach() {
  /opt/bin/nbd-client -d /dev/nbd0 </dev/null || return 1
  i=0; while [ "$(cat /sys/block/nbd0/size 2>/dev/null || echo 0)" -gt 0 ]; do
    i=$((i + 1)); [ $i -gt 100 ] && { echo "nbd0 still has a size after -d"; return 1; }; sleep 0.1
  done
}
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; blockdev --flushbufs /dev/nbd0; }
cleanup() {
  grep -q ' /mnt ' /proc/mounts && umount /mnt
  [ -n "$ATTACHED" ] && /opt/bin/nbd-client -d /dev/nbd0 </dev/null
}
# step() runs its command in a subshell, so attachment state is tracked here, around it.
do_attach() { ATTACHED=1; step attach attach; }
do_detach() { step detach detach && ATTACHED=; }

# --- scenario ext4: the full life of a filesystem on the export, verified from the server's
# bytes (caches dropped before fsck and before the read-only remount).
# dd with its error (not its statistics) on failure.
ddq() { dd "$@" 2>/run/dd.err || { grep -v records /run/dd.err; echo "dd $* failed"; return 1; }; }
write_files() {
  for n in 1 2; do
    ddq if=/dev/urandom of=/mnt/big$n bs=1M count=16 conv=fsync || return 1
  done
  # 200 small files (10 B .. 16 KiB) written by shell builtins: a fork per file costs ~8 ms
  # under TCG. Those in small/0 are fsynced one by one (50 jbd2 commits: FLUSH + FUA writes
  # interleaved with data); the rest reach the disk through the "sync" step.
  blob=$(head -c 12288 /dev/urandom | base64 -w 0) || return 1
  for d in 0 1 2 3; do
    mkdir -p /mnt/small/$d || return 1
    for f in $(seq 0 49); do
      len=$((RANDOM % ${#blob}))
      printf '%s %s\n' "$d/$f" "${blob:$len}" >/mnt/small/$d/f$f || { echo "writing small/$d/f$f failed"; return 1; }
    done
  done
  sync /mnt/small/0/* || { echo "fsync of small/0/* failed"; return 1; }
  # Freed blocks for fstrim to find.
  ddq if=/dev/urandom of=/mnt/scratch bs=1M count=1 conv=fsync && rm /mnt/scratch
}
checksum() {
  (cd /mnt && find . -type f ! -path './lost+found/*' | sort | xargs sha256sum) >/run/sums || return 1
  n=$(wc -l </run/sums); [ "$n" -eq 202 ] || { echo "expected 202 files, found $n"; return 1; }
  echo "$n files"
}
verify() {
  (cd /mnt && sha256sum -c /run/sums) >/run/verify 2>&1; rc=$?
  grep -v ': OK$' /run/verify; [ $rc -eq 0 ] && echo "$(grep -c ': OK$' /run/verify) files verified"
  return $rc
}
scenario_ext4() {
  do_attach || return 1
  step mkfs /opt/bin/mke2fs -t ext4 -F -q /dev/nbd0 || return 1
  step mount mount -t ext4 /dev/nbd0 /mnt || return 1
  step write write_files || return 1
  step sync sync || return 1
  step fstrim fstrim -v /mnt || return 1
  step checksum checksum || return 1
  step umount umount /mnt || return 1
  drop_caches
  step fsck /opt/bin/e2fsck -fn /dev/nbd0 || return 1
  drop_caches
  step mount-ro mount -t ext4 -o ro /dev/nbd0 /mnt || return 1
  step verify verify || return 1
  step umount-ro umount /mnt || return 1
  do_detach || return 1
}

# --- scenario readonly: the export is read-only. Reads work; the kernel marks the device
# read-only and every write (mkfs, a direct write) fails cleanly instead of hanging.
ro_flag() {
  ro=$(cat /sys/block/nbd0/ro)
  [ "$ro" = 1 ] || { echo "nbd0 ro=$ro: the server did not advertise NBD_FLAG_READ_ONLY"; return 1; }
}
scenario_readonly() {
  do_attach || return 1
  step ro-flag ro_flag || return 1
  step read dd if=/dev/nbd0 of=/dev/null bs=1M count=8 || return 1
  expect_fail mkfs-refused /opt/bin/mke2fs -t ext4 -F -q /dev/nbd0 || return 1
  expect_fail write-refused dd if=/dev/zero of=/dev/nbd0 bs=4096 count=1 oflag=direct || return 1
  do_detach || return 1
}

case $SCENARIO in
  ext4) scenario_ext4 ;;
  readonly) scenario_readonly ;;
  *) report "fail scenario unknown scenario '$SCENARIO'" ;;
esac || cleanup
report done
off
INIT
chmod +x "$ROOT/init"

# Uncompressed newc cpio: the kernel unpacks it without a decompressor (faster under TCG).
(cd "$ROOT" && find . | sort | cpio -o -H newc --quiet -R 0:0) >"$WORK/initrd.cpio"

mv -f "$vmlinux" "$OUTDIR/vmlinux"
mv -f "$WORK/initrd.cpio" "$OUTDIR/initrd.cpio"
echo "$STAMP" >"$OUTDIR/stamp"
log "built $OUTDIR/vmlinux ($KVER) and initrd.cpio ($(du -h "$OUTDIR/initrd.cpio" | cut -f1))"
