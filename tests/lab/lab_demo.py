"""`make lab-demo`: the demo of `make demo` on a lab of two subnets, with
Ansible doing the rollout over SSH and the client finding the far donor
through the lab's DNS, then a clean teardown.

    python3 tests/lab/lab_demo.py [--limit 24M] [--factor 3]

1. the lab (tests/lab/netlab.py): network namespaces on two bridges joined
   by a router namespace that forwards unicast only, so multicast DNS stays
   on its own subnet; each host with its own sshd and keys the lab
   generates; BIND on host ns serving the lab's zone
2. ansible/site.yml over SSH: donors on idle1, idle2 (subnet 1) and idle3
   (subnet 2), each publishing itself in the zone (netpager_discovery:
   dns); clients on busy1 and busy2 (subnet 1; mode mirror, swap), whose
   donors files name only idle1 and idle2; TLS and export tokens on
3. the zone's records, each client taking idle3 in through the DNS, and
   each host's role and status (again after the job)
4. a job: memhog in a memory cgroup touching FACTOR x its limit, so most of
   its pages go to busy1's device (the highest swap priority) and from
   there to the donors, idle3 across the router; it verifies every page
5. ansible/undeploy.yml (the donors take their records with them), the
   lab's teardown, and a check that nothing is left
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import netlab  # noqa: E402
from lab_ansible import CLIENTS, DNS_HOST, SUBNET2_HOSTS, AnsibleFailed, LabRollout, dns_lab, recap  # noqa: E402
from netpager_testkit import Teardown, install_handlers, swaps, wait_for  # noqa: E402
from netpager_testkit.dns import missing_tools  # noqa: E402
from netpager_testkit.demo import heading, parse_size, run_job  # noqa: E402
from netpager_testkit.paths import target_dir  # noqa: E402


def show_recap(out: str) -> None:
    for host, r in sorted(recap(out).items()):
        print(f"  {host:<7} ok={r['ok']} changed={r['changed']} failed={r['failed']}")


def leftovers(lab_root: Path) -> list[str]:
    left = [f"namespace {ns}" for ns in netlab.namespaces()]
    left += [f"interface {link}" for link in netlab.lab_links()]
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
    if missing_tools():
        raise SystemExit(f"lab demo: no {', '.join(missing_tools())} (Debian's bind9 and bind9-dnsutils: make deps)")

    install_handlers()
    td = Teardown("lab demo", announce=lambda what: print(f"undo: {what}", flush=True))
    parent = Path(tempfile.mkdtemp(prefix="netpager-lab-demo-", dir="/tmp"))
    td.add(f"directory {parent}", parent.rmdir)
    parent.chmod(0o755)
    lab_root = parent / "lab"
    ok = interrupted = False
    errors: list[str] = []
    try:
        heading(1, "The lab: two subnets, a router, the lab's DNS")
        lab, dns = dns_lab(td, lab_root)
        lab_root.chmod(0o755)
        far = SUBNET2_HOSTS[0]
        for n, (bridge, subnet) in enumerate(((netlab.BRIDGE, netlab.SUBNET), (netlab.BRIDGE2, netlab.SUBNET2)), 1):
            print(f"subnet {n}: bridge {bridge} {subnet} (the controller, this shell and Ansible, at "
                  f"{subnet.network_address + 1})")
            for h in lab.hosts.values():
                if h.subnet == subnet:
                    print(f"  {h.name:<7} {h.addr:<14} namespace {h.ns}, sshd pid {h.sshd.pid}")
        print(f"router: namespace {netlab.PREFIX}-router (.{netlab.ROUTER_HOST} on each), unicast only: "
              f"multicast DNS from subnet 1 never reaches {far}")
        print(f"DNS: BIND on {DNS_HOST} serving zone {dns.zone} at {dns.server}, taking updates signed "
              f"with TSIG key {dns.key_file.name}")
        ro = LabRollout(td, lab, dns=dns)

        heading(2, "Rollout: ansible-playbook site.yml over SSH, netpager_discovery: dns")
        print(f"  inventory {ro.inv / 'hosts.yml'} (TLS key and export secret beside it)", flush=True)
        for c in CLIENTS:
            print(f"  {c}'s donors file names {', '.join(ro.file_donors(c))}, its own subnet's", flush=True)
        show_recap(ro.ansible("site.yml").stdout)

        heading(3, f"The donors in {dns.zone}, and what the clients found there")
        service = f"_netpager._tcp.{dns.zone}"
        for ptr in sorted(dns.records(service, "PTR")):
            srv = dns.records(ptr, "SRV")
            target = srv[0].split()[-1] if srv else "?"
            print(f"  PTR {ptr}  SRV -> {target}  A {', '.join(dns.records(target, 'A'))}")
        for c in CLIENTS:
            wait_for(lambda c=c: any(d["name"] == far and d["joined"] == "discovered"
                                     for d in ro.client_status(c)["status"]["donors"]), 60,
                     f"{c} to take {far} in through the DNS")
        print(ro.roles_table())

        heading(4, f"Job: memhog swapping through busy1's device, {far} across the router, verifying every page")
        device = ro.client_status("busy1")["device"]
        limit = parse_size(args.limit)
        result = run_job(td, lab_root, device, limit, args.factor)
        st = ro.client_status("busy1")["status"]
        held = {d["name"]: d["extents_held"] for d in st["donors"]}
        print(f"  busy1's extents on the donors: {held}; lost {st['totals']['lost']}")
        print(ro.roles_table())
        ok = result.returncode == 0 and result.swap_device_peak_bytes[device] > 0 and st["totals"]["lost"] == 0
        if held.get(far, 0) == 0:
            print(f"  {far} (subnet 2) holds nothing of busy1's")
            ok = False

        heading(5, "Undeploy: ansible-playbook undeploy.yml over SSH")
        devices = [ro.client_status(c)["device"] for c in CLIENTS]
        show_recap(ro.ansible("undeploy.yml").stdout)
        still = [d for d in devices if d in swaps()]
        if still:
            print(f"  still swap after undeploy: {still}")
            ok = False
        records = dns.records(service, "PTR")
        print(f"  records left in {dns.zone}: {records or 'none (each donor removed its own at its clean stop)'}")
        ok = ok and not records
    except KeyboardInterrupt:
        interrupted = True
    except (AnsibleFailed, netlab.LabError, TimeoutError, RuntimeError) as e:
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
            print("nothing left behind (namespaces, bridges, router, sshd, named, keys, swap, loop devices all gone)")
    if interrupted:
        print("\nlab demo INTERRUPTED")
        return 130
    passed = ok and not errors and not left
    print("\nlab demo " + ("PASSED: Ansible rolled netpager out over SSH, busy1 found the donor behind the "
                           "router through the lab's DNS, the job's pages went to the donors on both subnets "
                           "and came back intact" if passed else "FAILED"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
