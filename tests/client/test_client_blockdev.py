"""The client as a block device: donors full (fallback file, or ENOSPC
without one), a filesystem surviving detach and a client crash, and fio
verifying its data through the loop device and through the client's own
NBD socket."""

from __future__ import annotations

import hashlib
import subprocess
import tomllib

import pytest

from netpager_testkit.client import MIB, donor_spec, nbd_errno, run_pagerctl
from netpager_testkit.attach import Mount, file_checksums

DEVICE = 64 * MIB


def fill(client, seed: str, size: int = DEVICE):
    """Writes the pattern over the device through the client's socket; returns
    the offset of the first write refused with ENOSPC, or None."""
    import nbd

    from netpager_testkit.nbdio import connect, pattern

    with connect(client.uri()) as h:
        for off in range(0, size, MIB):
            try:
                h.pwrite(pattern(seed, off, MIB), off)
            except nbd.Error as e:
                assert nbd_errno(e) == "ENOSPC", f"write at {off}: {e}"
                return off
        h.flush()
    return None


def verify(client, seed: str, end: int = DEVICE):
    from netpager_testkit.nbdio import connect, pattern

    with connect(client.uri()) as h:
        for off in range(0, end, MIB):
            assert h.pread(MIB, off) == pattern(seed, off, MIB), f"extent at {off} came back wrong"


def test_full_donors_spill_to_the_fallback_file(teardown, donors, client, tmp_path):
    # 4 donors x 8 MiB cannot hold a 64 MiB device; the fallback takes the rest.
    ds = donors(4, budget="8M")
    fallback = tmp_path / "fallback.img"
    client.attach(ds, mode="none", size="64M", frontend="nbd",
                  extra=["--fallback", fallback, "--fallback-size", "64M"])
    assert fill(client, "fb") is None
    verify(client, "fb")
    st = client.wait_status(lambda s: s["totals"]["on_fallback"] > 0, 30, "extents on the fallback")
    t = st["totals"]
    assert t["fallback_used_bytes"] > 0 and t["lost"] == 0, t
    assert t["fallback_path"] == str(fallback)
    for d in ds:
        s = d.status()
        assert s.used_bytes <= s.budget_bytes, s
    client.detach()
    assert client.leftovers() == []


def test_full_donors_without_fallback_give_enospc(teardown, donors, client):
    ds = donors(4, budget="8M")
    client.attach(ds, mode="none", size="64M", frontend="nbd")
    stopped = fill(client, "nospc")
    assert stopped is not None and stopped > 0, "every write fitted into 32 MiB of budgets"
    # What was accepted before the device filled up is intact.
    verify(client, "nospc", end=stopped)
    st = client.device_status()
    assert st["totals"]["lost"] == 0
    client.detach()
    assert client.leftovers() == []


def fsck_clean(device: str):
    p = subprocess.run(["fsck.ext4", "-n", "-f", device], capture_output=True, text=True)
    assert p.returncode == 0, f"fsck.ext4 -n {device}: {p.returncode}\n{p.stdout}\n{p.stderr}"


@pytest.mark.parametrize("mode,frontend", [("mirror", "fuse-uring"), ("parity", "fuse-uring"),
                                           ("parity", "fuse"), ("parity", "nbd")])
def test_filesystem_survives_detach_and_client_crash(mode, frontend, teardown, donors, client, tmp_path):
    ds = donors(4)
    dev = client.attach(ds, mode=mode, size="64M", frontend=frontend)
    assert client.frontend() == frontend
    subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True, capture_output=True)
    mnt = Mount(teardown, dev, tmp_path / "mnt")
    for i in range(8):
        (mnt.where / f"f{i}").write_bytes(hashlib.sha256(str(i).encode()).digest() * (40_000 + i))
    want = file_checksums(mnt.where, "f*")
    mnt.umount()
    client.detach()
    assert client.leftovers() == []

    # A clean re-attach finds its extent map and its data.
    dev = client.attach(ds, new_device=False)
    fsck_clean(dev)
    mnt = Mount(teardown, dev, tmp_path / "mnt")
    assert file_checksums(mnt.where, "f*") == want
    (mnt.where / "f-after-reattach").write_bytes(b"x" * 300_000)
    want = file_checksums(mnt.where, "f*")
    mnt.umount()
    subprocess.run(["sync"], check=True)

    # A crash: the serving process dies; detach cleans up what is left of
    # the attach, and the next attach serves the data the donors still hold.
    client.kill_server()
    client.detach()
    assert client.leftovers() == []
    dev = client.attach(ds, new_device=False)
    fsck_clean(dev)
    mnt = Mount(teardown, dev, tmp_path / "mnt")
    assert file_checksums(mnt.where, "f*") == want
    mnt.umount()
    client.detach()
    assert client.leftovers() == []


def test_reattach_refuses_another_device(teardown, donors, client):
    ds = donors(2)
    client.attach(ds, mode="mirror", size="64M")
    client.detach()
    p = run_pagerctl(["attach", "--state-dir", client.state_dir, "--size", "128M", "--mode", "mirror",
                      "--client-id", client.client_id]
                     + sum((["--donor", f"{d.addr}:{d.port},name={d.name},status={d.params['status']}"]
                            for d in ds), []), check=False)
    assert p.returncode != 0 and "differs in size" in p.stderr, p.stderr
    # Options given alone are compared alone, against what the device holds.
    p = run_pagerctl(["attach", "--state-dir", client.state_dir, "--size", "128M"], check=False)
    assert p.returncode != 0 and "differs in size:" in p.stderr, p.stderr
    p = run_pagerctl(["attach", "--state-dir", client.state_dir, "--parity-log", "8M"], check=False)
    assert p.returncode != 0 and "--parity-log: only applies to --mode parity" in p.stderr, p.stderr
    assert client.leftovers() == []


def test_reattach_keeps_the_devices_extent_size(teardown, donors, client):
    """A parity device made with 1 MiB extents (every parity device before
    the default followed the stripe) re-attaches with the same options and
    no --extent-size; asking for another extent size is refused by name."""
    ds = donors(3)
    client.attach(ds, mode="parity", size="64M", extra=["--extent-size", "1M"])
    client.detach()
    client.attach(ds, mode="parity", size="64M")
    config = tomllib.loads((client.state_dir / "device.toml").read_text())
    assert config["extent_size"] == MIB, config
    client.detach()
    p = run_pagerctl(["attach", "--state-dir", client.state_dir, "--size", "64M", "--mode", "parity",
                      "--client-id", client.client_id, "--extent-size", "256K"]
                     + sum((["--donor", donor_spec(d)] for d in ds), []), check=False)
    assert p.returncode != 0 and "differs in extent_size" in p.stderr, p.stderr
    assert client.leftovers() == []


def test_fio_verifies_through_the_device_and_the_socket(teardown, donors, client, tmp_path):
    from netpager_testkit.nbdio import fio

    ds = donors(4)
    dev = client.attach(ds, mode="parity", size="64M", frontend="nbd")
    common = ["--bs=4k", "--size=32M", "--verify=crc32c", "--verify_fatal=1", "--do_verify=1",
              "--randrepeat=0"]
    fio(["--name=loop", f"--filename={dev}", "--direct=1", "--ioengine=psync", "--rw=randwrite"]
        + common, tmp_path / "fio-loop.log")
    # A third-party NBD client on the client's own socket; the second half of
    # the device, so it does not overwrite what the first job verified.
    fio(["--name=nbd", "--ioengine=nbd", f"--uri={client.uri()}", "--rw=randwrite",
         "--offset=32M", "--iodepth=8"] + common, tmp_path / "fio-nbd.log")
    assert client.device_status()["totals"]["lost"] == 0
    client.detach()
    assert client.leftovers() == []


@pytest.mark.parametrize("frontend", ["fuse-uring", "fuse", "nbd"])
def test_fio_verifies_randrw_on_each_front_end(frontend, teardown, donors, client, tmp_path):
    from netpager_testkit.nbdio import fio

    ds = donors(4)
    dev = client.attach(ds, mode="parity", size="64M", frontend=frontend)
    assert client.frontend() == frontend
    fio(["--name=randrw", f"--filename={dev}", "--direct=1", "--ioengine=libaio", "--iodepth=8",
         "--rw=randrw", "--numjobs=4", "--bs=4k", "--size=16M", "--offset_increment=16M",
         "--verify=crc32c", "--verify_fatal=1", "--do_verify=1", "--randrepeat=0"],
        tmp_path / "fio.log")
    assert client.device_status()["totals"]["lost"] == 0
    client.detach()
    assert client.leftovers() == []
