#!/bin/busybox sh
# /init of the test VM's initramfs (netpager_testkit.vm builds it with
# busybox-static and the modules listed in /modules.order): loads what it
# takes to reach the host's root, mounts it read-only over 9p under a tmpfs
# overlay, binds the VM kernel's modules where modprobe looks, and
# switch_roots into it to run the guest program (tests/vm/guest.py) named on the command line.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev

fail() {
  echo "vm-init: $*" >&2
  echo o >/proc/sysrq-trigger
  sleep 60
}

arg() {
  for w in $(cat /proc/cmdline); do
    case "$w" in "$1="*) echo "${w#*=}" ;; esac
  done
}

while read -r m; do
  insmod "/modules/$m" || fail "insmod $m failed"
done </modules.order

mkdir -p /lower /rw /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /lower \
  || fail "cannot mount the host's root over 9p"
mount -t tmpfs -o mode=0755 rw /rw || fail "cannot mount the overlay's tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot \
  || fail "cannot mount the overlay"

modules=$(arg np.modules)
release=$(uname -r)
mkdir -p "/newroot/lib/modules/$release"
mount --bind "/newroot$modules" "/newroot/lib/modules/$release" \
  || fail "cannot bind $modules to /lib/modules/$release"

guest=$(arg np.guest)
[ -f "/newroot$guest" ] || fail "no guest script $guest in the host's root"
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /usr/bin/python3 "$guest"
