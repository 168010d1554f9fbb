"""PID 1 of the test VM (netpager_testkit.vm), run by tests/vm/init.sh once
the host's root is mounted read-only under a tmpfs overlay.

It makes the VM an ordinary Debian 12 machine (proc, sys, cgroup v2, /run,
/tmp and /var/tmp on the scratch disk, loopback up, the modules the tests
use), runs pytest as the host asked in `request.json` on the `out` 9p
share, copies its output to the console and the share, reaps every orphan
(it is PID 1), writes the exit status, the kernel log and the tests' logs
to the share, and powers the VM off. Nothing here touches the host: its
root is read-only and the share is the run's own directory.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback

OUT = "/run/vm-out"
SCRATCH = "/scratch"
# What the tests need loaded up front (devices that must exist before a
# test looks: /dev/nbd0, /dev/fuse, /dev/loop-control); the rest (netfilter,
# bridges, qdiscs) the kernel loads on demand through modprobe.
MODULES = ["nbd", "loop", "fuse", "ext4", "veth", "bridge", "sch_netem", "sch_tbf", "zram"]
LINUX_REBOOT_CMD_POWER_OFF = 0x4321FEDC
MCL_CURRENT, MCL_FUTURE = 1, 2
LOG_COPY_S = 20


def log(msg: str) -> None:
    print(f"vm-guest: {msg}", flush=True)


def run(*argv: str, check: bool = True) -> None:
    subprocess.run(argv, check=check, stdin=subprocess.DEVNULL)


def mount(fstype: str, source: str, target: str, options: str | None = None) -> None:
    os.makedirs(target, exist_ok=True)
    argv = ["mount", "-t", fstype]
    if options:
        argv += ["-o", options]
    run(*argv, source, target)


def setup() -> None:
    # The kernel starts PID 1 with an environment of its own.
    os.environ.update(PATH="/usr/sbin:/usr/bin:/sbin:/bin", HOME="/root", LANG="C.UTF-8")
    # Never swapped out: a test whose swap device fails (the whole-machine
    # test) would otherwise kill PID 1 with SIGBUS on a read error, and the
    # kernel's panic lost the run's every result.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mlockall(MCL_CURRENT | MCL_FUTURE) != 0:
        log(f"mlockall: errno {ctypes.get_errno()}")
    mount("proc", "proc", "/proc")
    mount("sysfs", "sys", "/sys")
    mount("devpts", "devpts", "/dev/pts", "gid=5,mode=620,ptmxmode=666")
    mount("tmpfs", "shm", "/dev/shm", "mode=1777")
    mount("tmpfs", "run", "/run", "mode=755")
    mount("cgroup2", "cgroup2", "/sys/fs/cgroup")
    mount("9p", "out", OUT, "trans=virtio,version=9p2000.L,msize=512000")
    for m in MODULES:
        run("modprobe", m)
    # The scratch disk: a swap file, state directories and logs on a real
    # file system, not in the overlay's memory.
    run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,nodiscard", "/dev/vda")
    mount("ext4", "/dev/vda", SCRATCH)
    for d, target in (("tmp", "/tmp"), ("var-tmp", "/var/tmp")):
        os.makedirs(f"{SCRATCH}/{d}", exist_ok=True)
        os.chmod(f"{SCRATCH}/{d}", 0o1777)
        run("mount", "--bind", f"{SCRATCH}/{d}", target)
    run("ip", "link", "set", "lo", "up")
    run("hostname", "netpager-vm")


def follow_kernel_log() -> None:
    """The kernel's log to the share as it comes (every level: the
    console shows warnings only), so that a VM that hangs or panics still
    leaves its hung tasks' stacks. A thread of PID 1, whose memory is
    locked: a `dmesg --follow` stopped with the rest of a VM out of memory."""
    def follow() -> None:
        kmsg = os.open("/dev/kmsg", os.O_RDONLY)
        with open(f"{OUT}/dmesg-live.log", "wb", buffering=0) as out:
            while True:
                try:
                    rec = os.read(kmsg, 8192)
                except BrokenPipeError:  # records overwritten before we read them
                    continue
                # "PRIO,SEQ,USEC,FLAGS;TEXT\n": the time in seconds, the text.
                head, _, text = rec.partition(b";")
                fields = head.split(b",")
                usec = int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else 0
                out.write(b"[%6d.%06d] " % divmod(usec, 1000000) + text)

    threading.Thread(target=follow, daemon=True).start()


def pump(src, dests) -> None:
    """Copies the test run's output, line by line, to the console and the
    share as it comes."""
    for line in iter(src.readline, b""):
        for d in dests:
            d.write(line)
            d.flush()


def debug_shell() -> None:
    """A root shell on the second serial port, for a developer watching a
    run (`VM_DEBUG=1`: the host puts the port on a unix socket)."""
    subprocess.Popen(["setsid", "sh", "-c", "exec bash -i </dev/ttyS1 >/dev/ttyS1 2>&1"],
                     stdin=subprocess.DEVNULL)


def run_tests(req: dict) -> int:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "NETPAGER_VM": "1"}
    env.update(req.get("env", {}))
    argv = ["/usr/bin/python3", "-m", "pytest", "-p", "no:cacheprovider", "-v", "-ra",
            "--durations=20", f"--junitxml={OUT}/junit.xml", "--basetemp=/tmp/pytest-vm",
            *req["args"]]
    log(f"running {' '.join(argv)} in {req['root']}")
    proc = subprocess.Popen(argv, cwd=req["root"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with open(f"{OUT}/pytest.log", "wb") as out_log:
        console = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
        t = threading.Thread(target=pump, args=(proc.stdout, [console, out_log]), daemon=True)
        t.start()
        # Ask pytest to stop (it undoes what its tests set up and writes its
        # summary) before the host's bound ends the VM.
        deadline = time.monotonic() + float(req["timeout"])
        interrupted = False
        status = None
        copied = time.monotonic()
        while status is None:
            # The tests' logs to the share now and then, not only at the
            # end: a test that hangs the VM still leaves what it logged.
            if time.monotonic() - copied > LOG_COPY_S:
                try:
                    copy_texts("/tmp/pytest-vm", f"{OUT}/logs")
                except OSError as e:  # a file went while it was copied
                    log(f"copying the logs: {e}")
                copied = time.monotonic()
            # PID 1: every orphan in the VM becomes ours to reap.
            pid, st = os.waitpid(-1, os.WNOHANG)
            if pid == proc.pid:
                status = os.waitstatus_to_exitcode(st)
                break
            if pid == 0:
                time.sleep(0.2)
            if not interrupted and time.monotonic() > deadline:
                log(f"the tests ran past {req['timeout']} s: interrupting them")
                proc.send_signal(signal.SIGINT)
                interrupted = True
        t.join(timeout=10)
    return status


def copy_texts(src: str, dest: str, limit: int = 4 << 20) -> None:
    """The logs and records under `src` (not the devices' images, sockets
    or swap files) into `dest`. Never into a mount point (a test's FUSE
    mount): a stuck server there would hang PID 1."""
    with open("/proc/self/mountinfo") as f:
        mounts = {line.split()[4] for line in f}
    for top, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if os.path.join(top, d) not in mounts]
        for name in files:
            path = os.path.join(top, name)
            if not name.endswith((".log", ".json", ".txt", ".toml", ".xml")) \
                    or not os.path.isfile(path) or os.path.getsize(path) > limit:
                continue
            to = os.path.join(dest, os.path.relpath(path, src))
            os.makedirs(os.path.dirname(to), exist_ok=True)
            shutil.copyfile(path, to)


def collect(rc: int, root: str | None) -> None:
    with open(f"{OUT}/rc", "w") as f:
        f.write(f"{rc}\n")
    with open(f"{OUT}/dmesg.log", "wb") as f:
        subprocess.run(["dmesg"], stdout=f, check=False)
    # The tests' own logs (daemons, jobs), for a failure's post-mortem, and
    # what the tests recorded in the tree (it is the overlay's copy here).
    copy_texts("/tmp/pytest-vm", f"{OUT}/logs")
    if root:
        copy_texts(f"{root}/bench-results", f"{OUT}/bench-results")


def power_off() -> None:
    os.sync()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.reboot(LINUX_REBOOT_CMD_POWER_OFF)
    # Not reached; if it were, PID 1 exiting panics the kernel and the
    # host's -no-reboot ends the VM all the same.


def main() -> None:
    rc, root = 1, None
    try:
        setup()
        follow_kernel_log()
        with open(f"{OUT}/request.json") as f:
            req = json.load(f)
        root = req["root"]
        if req.get("debug"):
            debug_shell()
        rc = run_tests(req)
    except BaseException:  # noqa: BLE001 - PID 1 must power off whatever happened
        log(f"failed:\n{traceback.format_exc()}")
    try:
        collect(rc, root)
    except BaseException as e:  # noqa: BLE001
        log(f"collecting the results failed: {e!r}")
    log(f"done, exit status {rc}")
    power_off()


if __name__ == "__main__":
    main()
