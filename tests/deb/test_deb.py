"""The Debian packages (issue 28), installed into a fresh Debian 12 root.

`scripts/deb.sh` builds netpager-donor, netpager-client and
netpager-prefetchd from the release build (lintian must pass). A Debian 12
root made by mmdebstrap with the packages' dependencies (cached in
/var/cache/netpager-test/, keyed by that list) is unpacked into a temporary
directory; inside it, with no network (`unshare --net`), apt installs the
packages, the commands run, an upgrade leaves an attached device alone,
and remove then purge leave the root exactly as it was.
"""

from __future__ import annotations

import re
import shutil

from debroot import COMMANDS, PACKAGES, Root, base_root
from netpager_testkit import Teardown


def test_install_use_upgrade_remove_purge_in_a_fresh_debian_root(debs):
    td = Teardown("debian root")
    try:
        root = Root(td, base_root(debs))
        before = root.tree()
        (root.dir / "tmp" / "debs").mkdir()
        for deb in debs.values():
            shutil.copy(deb, root.dir / "tmp" / "debs")
        names = " ".join(f"/tmp/debs/{d.name}" for d in debs.values())
        root.check(f"apt-get install -y {names}")

        # The plugin by name, as `nbdkit memory` works.
        help_text = root.check("nbdkit pager-server --help")
        assert "budget=" in help_text, help_text
        assert root.check("nbdkit --dump-config | sed -n 's/^plugindir=//p'").strip() + \
            "/nbdkit-pager-server-plugin.so" in root.check("dpkg -L netpager-donor")

        # Every command says its package's version and commit.
        for pkg, commands in COMMANDS.items():
            version = root.check(f"dpkg-query -W -f '${{Version}}' {pkg}").strip()
            for c in commands:
                out = root.check(f"{c} --version").strip()
                assert re.fullmatch(rf"{re.escape(c)} {re.escape(version)} \(commit [0-9a-f]{{40}}\)", out), out

        for page, section in [("pagerctl", 1), ("pager-server", 1), ("pager-client-plugin", 1), ("prefetchd", 8),
                              ("netpager-token", 1), ("netpager-drain", 1), ("pager-hints", 1),
                              ("prefetch-job", 1)]:
            assert root.check(f"man -w {page}").strip() == f"/usr/share/man/man{section}/{page}.{section}.gz"

        # Units installed, none enabled; configurations are conffiles.
        for pkg in PACKAGES:
            assert (root.dir / "usr/lib/systemd/system" / f"{pkg}.service").exists()
            conf = "/etc/netpager/" + pkg.removeprefix("netpager-") + ".conf"
            assert conf in root.check(f"dpkg-query -W -f '${{Conffiles}}' {pkg}")
        assert not list((root.dir / "etc/systemd/system").glob("**/netpager-*")), "a unit was enabled"

        # An upgrade (here: the same package again) with a device attached
        # leaves it attached and says when the new version takes effect
        # (a record without a device: not restartable; real devices, a
        # restartable one moved onto the new pagerctl, in
        # tests/client/test_client_upgrade.py).
        attached = root.dir / "var/lib/netpager/swap"
        attached.mkdir(parents=True)
        (attached / "attach.json").write_text("{}\n")
        (root.dir / "var/lib/netpager/client").mkdir()  # the packaged unit's StateDirectory
        out = root.check(f"dpkg -i /tmp/debs/{debs['netpager-client'].name}")
        assert "/var/lib/netpager/swap: attached, not restartable, left as it is" in out, out
        assert "takes effect at its next attach" in out, out
        assert (attached / "attach.json").exists()

        # Remove keeps the configuration, purge takes it and the package's
        # state, and nothing else.
        (root.dir / "etc/netpager/donor.conf").write_text("# edited\n")
        root.check("apt-get remove -y " + " ".join(PACKAGES))
        assert (root.dir / "etc/netpager/donor.conf").read_text() == "# edited\n"
        root.check("apt-get purge -y " + " ".join(PACKAGES))
        assert (attached / "attach.json").exists(), "purge removed state the package did not create"
        assert not (root.dir / "var/lib/netpager/client").exists()
        shutil.rmtree(root.dir / "var/lib/netpager")
        shutil.rmtree(root.dir / "tmp" / "debs")
        after = root.tree()
        left = sorted(set(after) - set(before))
        gone = sorted(set(before) - set(after))
        changed = sorted(p for p in set(before) & set(after) if before[p] != after[p])
        assert (left, gone, changed) == ([], [], []), (left, gone, changed)
        assert root.check("dpkg-query -W -f '${Package}\\n' 'netpager-*' 2>/dev/null || true").strip() == ""
    finally:
        errors = td.close()
    assert not errors, errors
