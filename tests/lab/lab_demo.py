"""`make lab-demo`: the demo of `make demo` on a lab of five hosts, with
Ansible doing the rollout over SSH, then a clean teardown.

    python3 tests/lab/lab_demo.py [--limit 24M] [--factor 3]

1. the lab (tests/lab/netlab.py): five network namespaces on one bridge,
   each with its own sshd and keys the lab generates
2. ansible/site.yml over SSH: donors on idle1..idle3, clients on busy1 and
   busy2 (mode mirror, swap), TLS and export tokens on
3. each host's role and status (again after the job)
4. a job: memhog in a memory cgroup touching FACTOR x its limit, so most of
   its pages go to busy1's device (the highest swap priority) and from
   there across the bridge to the donors; it verifies every page
5. ansible/undeploy.yml, the lab's teardown, and a check that nothing is left
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import netlab  # noqa: E402
from lab_ansible import CLIENTS, HOSTS, AnsibleFailed, LabRollout, recap  # noqa: E402
from netpager_testkit import Teardown, install_handlers, swaps  # noqa: E402
from netpager_testkit.demo import heading, parse_size, run_job  # noqa: E402
from netpager_testkit.paths import target_dir  # noqa: E402


def show_recap(out: str) -> None:
    for host, r in sorted(recap(out).items()):
        print(f"  {host:<7} ok={r['ok']} changed={r['changed']} failed={r['failed']}")


def leftovers(lab_root: Path) -> list[str]:
    left = [f"namespace {ns}" for ns in netlab.namespaces()]
    if netlab.bridge_exists():
        left.append(f"bridge {netlab.BRIDGE}")
    left += [f"loop {d}" for d in netlab.loops_under(lab_root)]
    if lab_root.exists():
        left.append(f"directory {lab_root}")
    return left


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="netpager lab demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", default="24M", help="the job's memory cgroup limit")
    ap.add_argument("--factor", type=int, default=3, help="the job touches FACTOR x limit")
    args = ap.parse_args(argv)
    missing = [b for b in ("libpager_server.so", "pagerctl", "netpager-token") if not (target_dir() / b).exists()]
    if missing:
        raise SystemExit(f"lab demo: not built in {target_dir()}: {', '.join(missing)}; run `make build` first")

    install_handlers()
    td = Teardown("lab demo", announce=lambda what: print(f"undo: {what}", flush=True))
    parent = Path(tempfile.mkdtemp(prefix="netpager-lab-demo-", dir="/tmp"))
    td.add(f"directory {parent}", parent.rmdir)
    parent.chmod(0o755)
    lab_root = parent / "lab"
    ok = interrupted = False
    errors: list[str] = []
    try:
        heading(1, "The lab: five hosts in network namespaces, one bridge")
        lab = netlab.Lab(td, lab_root, HOSTS)
        lab_root.chmod(0o755)
        print(f"bridge {netlab.BRIDGE} {lab.controller}/{netlab.SUBNET.prefixlen} (the controller: "
              "this shell, Ansible)")
        for h in lab.hosts.values():
            print(f"  {h.name:<7} {h.addr:<14} namespace {h.ns}, sshd pid {h.sshd.pid}")
        ro = LabRollout(td, lab)

        heading(2, "Rollout: ansible-playbook site.yml over SSH")
        print(f"  inventory {ro.inv / 'hosts.yml'} (TLS key and export secret beside it)", flush=True)
        show_recap(ro.ansible("site.yml").stdout)

        heading(3, "Each host's role and status")
        print(ro.roles_table())

        heading(4, "Job: memhog swapping through busy1's device, verifying every page")
        device = ro.client_status("busy1")["device"]
        limit = parse_size(args.limit)
        result = run_job(td, lab_root, device, limit, args.factor)
        st = ro.client_status("busy1")["status"]
        held = {d["name"]: d["extents_held"] for d in st["donors"]}
        print(f"  busy1's extents on the donors: {held}; lost {st['totals']['lost']}")
        print(ro.roles_table())
        ok = result.returncode == 0 and result.swap_device_peak_bytes[device] > 0 and st["totals"]["lost"] == 0

        heading(5, "Undeploy: ansible-playbook undeploy.yml over SSH")
        devices = [ro.client_status(c)["device"] for c in CLIENTS]
        show_recap(ro.ansible("undeploy.yml").stdout)
        still = [d for d in devices if d in swaps()]
        if still:
            print(f"  still swap after undeploy: {still}")
            ok = False
    except KeyboardInterrupt:
        interrupted = True
    except (AnsibleFailed, netlab.LabError) as e:
        print(f"lab demo: {e}")
    finally:
        heading(6, "Teardown")
        errors = td.close()
        for e in errors:
            print(f"cleanup error: {e}")
        left = leftovers(lab_root) + ([f"directory {parent}"] if parent.exists() else [])
        if left:
            print("LEFT BEHIND: " + ", ".join(left))
        elif not errors:
            print("nothing left behind (namespaces, bridge, sshd, keys, swap, loop devices all gone)")
    if interrupted:
        print("\nlab demo INTERRUPTED")
        return 130
    passed = ok and not errors and not left
    print("\nlab demo " + ("PASSED: Ansible rolled netpager out over SSH, the job's pages crossed the "
                           "bridge to the donors and came back intact" if passed else "FAILED"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
