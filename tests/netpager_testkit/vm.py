"""The test VM: what this machine's kernel lacks, run under Debian's own.

This machine's kernel has no nbd module and no netem, its cgroups are v1
and its root lacks CAP_SYS_RESOURCE. Debian 12's kernel has all four, so
`run_vm` boots it under qemu (software emulation: slow, fine for
correctness, useless for timings) and runs named pytest files inside:

- everything comes from Debian packages: the kernel (`apt-get download`
  of the package `linux-image-amd64` depends on, unpacked with
  `dpkg-deb -x`, its modules indexed with `depmod`), busybox-static for
  the initramfs, qemu-system-x86; cached under `target/vm/` (or
  `$NETPAGER_VM_CACHE`), rebuilt when the kernel, busybox or
  tests/vm/init.sh change;
- the initramfs (tests/vm/init.sh) loads virtio, 9p and overlay, mounts
  this machine's root read-only over 9p under a tmpfs overlay and
  switch_roots into it, so the guest runs this tree's binaries and
  Debian's python3, nbdkit and tools; PID 1 there is tests/vm/guest.py;
- a scratch disk (a sparse file, removed after the run) holds /tmp and
  /var/tmp, a writable 9p share the run's results: `request.json` in,
  `pytest.log`, `junit.xml`, `rc`, `dmesg.log` and the tests' logs out;
  the serial console goes to `console.log` and to our stdout as it comes;
- one boot per run, bounded in wall-clock time: past `timeout` the guest
  interrupts pytest (which undoes its tests' setup and writes its
  summary), 90 s later qemu is stopped. qemu is our child in its own
  session, stopped on every exit path (pass, fail, timeout, Ctrl-C,
  SIGTERM) by the run's Teardown; nothing is mounted on this machine.

Run it with `make test-vm` (`VM_TESTS=...` names the files) or
`python3 -m netpager_testkit.vm FILE...`; `make test` runs a short slice
(tests/vm/test_vm.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from .cleanup import Teardown, install_handlers
from .paths import repo_root

QEMU = "qemu-system-x86_64"
BUSYBOX = Path("/bin/busybox")
# What the initramfs loads to reach the host's root (with their
# dependencies, from the kernel's own modules.dep).
INITRAMFS_MODULES = ["virtio_pci", "virtio_blk", "virtio-rng", "9pnet_virtio", "9p", "overlay"]
SCRATCH_BYTES = 8 << 30
# After the guest's own deadline: time to undo the tests' setup, write the
# results and power off, under software emulation.
GRACE_S = 90
# The VM runs niced: under software emulation each virtual CPU takes a
# whole host CPU, and the machine is shared.
NICE = 10


def cache_dir() -> Path:
    env = os.environ.get("NETPAGER_VM_CACHE")
    return Path(env) if env else repo_root() / "target" / "vm"


def why_not() -> str | None:
    """Why the VM cannot run on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "the VM needs root (it exports / read-only to the guest over 9p)"
    for tool, package in ((QEMU, "qemu-system-x86"), ("apt-get", "apt"), ("dpkg-deb", "dpkg"),
                          ("depmod", "kmod")):
        if not shutil.which(tool):
            return f"no {tool} (Debian package {package}; `make deps` installs it)"
    if not BUSYBOX.exists():
        return f"no {BUSYBOX} (Debian package busybox-static; `make deps` installs it)"
    return None


def _run(argv: list, **kw) -> str:
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed ({p.returncode}): "
                           f"{(p.stderr or p.stdout).strip()}")
    return p.stdout


def kernel_package() -> str:
    """The kernel image package Debian's `linux-image-amd64` depends on now."""
    def resolve() -> str | None:
        p = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], capture_output=True,
                           text=True)
        for line in p.stdout.splitlines():
            word = line.strip().split()
            if len(word) == 2 and word[0] == "Depends:" and word[1].startswith("linux-image-"):
                return word[1]
        return None

    pkg = resolve()
    if pkg is None:
        _run(["apt-get", "update", "-qq"])
        pkg = resolve()
    if pkg is None:
        raise RuntimeError("apt-cache knows no linux-image-amd64: is Debian's main archive in "
                           "the apt sources?")
    return pkg


@dataclass
class Image:
    release: str
    vmlinuz: Path
    modules: Path
    initrd: Path


def _kernel(cache: Path) -> tuple[str, Path]:
    """The unpacked kernel: (release, its root); downloaded once."""
    kdir = cache / "kernel"
    ready = sorted(kdir.glob("*/ready"))
    if ready:
        root = ready[-1].parent
        return root.name, root
    pkg = kernel_package()
    release = pkg.removeprefix("linux-image-")
    dl = cache / "download"
    shutil.rmtree(dl, ignore_errors=True)
    dl.mkdir(parents=True)
    print(f"vm: downloading {pkg} (Debian's kernel for the VM)", flush=True)
    _run(["apt-get", "download", pkg], cwd=dl)
    debs = list(dl.glob("*.deb"))
    if len(debs) != 1:
        raise RuntimeError(f"apt-get download {pkg} left {debs} in {dl}")
    root = kdir / release
    tmp = kdir / f"{release}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _run(["dpkg-deb", "-x", debs[0], tmp])
    # The package ships no modules.dep: its postinst would make it.
    _run(["depmod", "-b", tmp, release])
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    (root / "ready").write_text(f"{debs[0].name}\n")
    shutil.rmtree(dl)
    return release, root


def _cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (path, mode, data) entries, as the kernel
    unpacks an initramfs; directories have empty data."""
    out = bytearray()
    ino = 1
    for name, mode, data in [*entries, ("TRAILER!!!", 0, b"")]:
        nb = name.encode() + b"\0"
        nlink = 2 if mode & 0o040000 else 1
        hdr = "070701" + "".join(f"{v:08X}" for v in (
            ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        out += hdr.encode() + nb
        out += b"\0" * (-len(out) % 4)
        out += data
        out += b"\0" * (-len(out) % 4)
        ino += 1
    return bytes(out)


def _initrd(cache: Path, release: str, kroot: Path) -> Path:
    init = (repo_root() / "tests" / "vm" / "init.sh").read_bytes()
    busybox = BUSYBOX.read_bytes()
    order: list[Path] = []
    for m in INITRAMFS_MODULES:
        out = _run(["modprobe", "-d", kroot, "-S", release, "--show-depends", m])
        for line in out.splitlines():
            w = line.split()
            if w and w[0] == "insmod" and Path(w[1]) not in order:
                order.append(Path(w[1]))
    h = hashlib.sha256(init + busybox + release.encode())
    for p in order:
        h.update(p.name.encode())
    path = cache / f"initrd-{h.hexdigest()[:16]}.cpio"
    if path.exists():
        return path
    d, x = 0o040755, 0o100755
    entries = [("bin", d, b""), ("bin/busybox", x, busybox), ("init", x, init),
               ("modules", d, b""), ("proc", d, b""), ("sys", d, b""), ("dev", d, b""),
               ("modules.order", 0o100644, "".join(f"{p.name}\n" for p in order).encode())]
    entries += [(f"modules/{p.name}", 0o100644, p.read_bytes()) for p in order]
    for old in cache.glob("initrd-*.cpio"):
        old.unlink()
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(_cpio_newc(entries))
    tmp.rename(path)
    return path


def build() -> Image:
    """The VM's kernel and initramfs, from the cache or made now."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    release, kroot = _kernel(cache)
    return Image(release, kroot / "boot" / f"vmlinuz-{release}",
                 kroot / "lib" / "modules" / release, _initrd(cache, release, kroot))


@dataclass
class Case:
    name: str
    outcome: str  # passed, failed, error, skipped
    message: str = ""


@dataclass
class VmRun:
    out: Path
    rc: int | None
    timed_out: bool
    seconds: float
    cases: list[Case] = field(default_factory=list)

    def tail(self, name: str = "console.log", lines: int = 60) -> str:
        try:
            text = (self.out / name).read_text(errors="replace")
        except FileNotFoundError:
            return f"(no {name})"
        return "\n".join(text.splitlines()[-lines:])

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for c in self.cases:
            counts[c.outcome] = counts.get(c.outcome, 0) + 1
        what = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test result"
        if self.timed_out:
            end = "timed out"
        elif self.rc == 2:
            # pytest's status when interrupted: the junit then calls the
            # test under way passed.
            end = "interrupted at the time bound (exit status 2)"
        else:
            end = f"exit status {self.rc}"
        return f"VM run in {self.out}: {what}; {end} after {self.seconds:.0f} s"


def _cases(junit: Path) -> list[Case]:
    if not junit.exists():
        return []
    out = []
    for tc in ET.parse(junit).getroot().iter("testcase"):
        name = f"{tc.get('classname')}::{tc.get('name')}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = tc.find(kind)
            if el is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = el.get("message") or (el.text or "")
                break
        out.append(Case(name, outcome, message.strip()))
    return out


def _prune(runs: Path, keep: int) -> None:
    old = sorted(p for p in runs.iterdir() if p.is_dir())[:-keep]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)


def run_vm(tests: list[str], timeout: float, mem_mib: int = 2048, cpus: int = 2,
           env: dict | None = None, echo=sys.stdout) -> VmRun:
    """Boots the VM once, runs `pytest TESTS` in it for at most `timeout`
    seconds (plus GRACE_S to finish), returns what came back."""
    image = build()
    runs = cache_dir() / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    _prune(runs, 4)
    out = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs))
    share = out / "share"
    share.mkdir(parents=True)
    passed_env = {k: v for k, v in os.environ.items()
                  if k in ("CI", "NETPAGER_FAULTS", "NETPAGER_REQUIRE_SERVER")}
    passed_env.update(env or {})
    root = repo_root().resolve()
    passed_env["NETPAGER_ROOT"] = str(root)
    debug = os.environ.get("VM_DEBUG", "") not in ("", "0")
    request = {"root": str(root), "args": list(tests), "env": passed_env, "timeout": timeout,
               "debug": debug}
    (share / "request.json").write_text(json.dumps(request, indent=1) + "\n")
    console = out / "console.log"
    console.touch()
    td = Teardown("vm")
    start = time.monotonic()
    try:
        scratch = out / "scratch.img"
        td.add(f"remove {scratch}", lambda: scratch.unlink(missing_ok=True))
        with open(scratch, "wb") as f:
            f.truncate(SCRATCH_BYTES)
        append = " ".join([
            "console=ttyS0", "panic=-1", "loglevel=4", "quiet",
            f"np.modules={image.modules}", f"np.guest={root}/tests/vm/guest.py"])
        argv = ["nice", "-n", str(NICE), QEMU, "-accel", "tcg,thread=multi",
                "-machine", "q35", "-cpu", "max", "-smp", str(cpus), "-m", str(mem_mib),
                "-nodefaults", "-nographic", "-no-reboot", "-no-user-config",
                "-kernel", image.vmlinuz, "-initrd", image.initrd, "-append", append,
                "-serial", f"file:{console}",
                "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                           "multidevs=remap",
                "-virtfs", f"local,path={share},mount_tag=out,security_model=none",
                "-drive", f"file={scratch},if=virtio,format=raw,cache=unsafe",
                "-device", "virtio-rng-pci", "-nic", "none"]
        if debug:
            # A root shell in the guest on this socket (tests/vm/guest.py).
            argv += ["-serial", f"unix:{out / 'debug.sock'},server=on,wait=off"]
            print(f"vm: a root shell in the VM: {out / 'debug.sock'}", file=echo, flush=True)
        from .procs import OwnedProcess

        qemu = OwnedProcess(argv, out / "qemu.log", td, "qemu", stop_timeout=15)
        deadline = start + timeout + GRACE_S
        pos = 0
        timed_out = False
        while True:
            done = qemu.wait(0.5) is not None
            with open(console, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            pos += len(chunk)
            if chunk and echo:
                echo.write(chunk.decode(errors="replace"))
                echo.flush()
            if done:
                break
            if time.monotonic() > deadline:
                timed_out = True
                print(f"vm: no result after {timeout + GRACE_S:.0f} s: stopping qemu", file=echo)
                qemu.stop()
                break
    finally:
        td.close_or_raise()
    rc_file = share / "rc"
    rc = int(rc_file.read_text()) if rc_file.exists() else None
    return VmRun(out, rc, timed_out, time.monotonic() - start, _cases(share / "junit.xml"))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python3 -m netpager_testkit.vm",
                                 description="Run pytest files inside the test VM (Debian's "
                                             "kernel under qemu: kernel nbd, cgroup v2, netem).")
    ap.add_argument("tests", nargs="+", help="pytest arguments (files relative to the tree's "
                    "root, -k ...), run in the VM; options pytest and this share go after --")
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("VM_TIMEOUT", 1800)),
                    help="seconds the tests may run (default 1800, $VM_TIMEOUT)")
    ap.add_argument("--mem", type=int, default=int(os.environ.get("VM_MEM", 2048)),
                    help="the VM's memory in MiB (default 2048, $VM_MEM)")
    ap.add_argument("--cpus", type=int, default=int(os.environ.get("VM_CPUS", 2)),
                    help="virtual CPUs (default 2, $VM_CPUS)")
    a, more = ap.parse_known_args()
    reason = why_not()
    if reason:
        print(f"vm: cannot run: {reason}", file=sys.stderr)
        return 2
    install_handlers()
    r = run_vm(a.tests + more, a.timeout, a.mem, a.cpus)
    print(r.summary())
    for c in r.cases:
        if c.outcome != "passed":
            print(f"  {c.outcome}: {c.name}: {c.message.splitlines()[0] if c.message else ''}")
    if r.timed_out:
        return 124
    return r.rc if r.rc is not None else 1


if __name__ == "__main__":
    sys.exit(main())
