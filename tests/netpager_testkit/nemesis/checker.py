"""The nemesis's checks on a device's status (pure code: the status and
what the donors report come in as data).

- `status_problems`: `pagerctl status --json` as the tools read it: the
  fields and their types.
- `settle_problems`: whether a device has reached what the model says it
  must after a settle (its donors, how each joined, which are failed, which
  hold nothing, nothing lost, degraded, rebuilding or draining, the donors
  file's error, the announced donors it did not take).
- `invariant_problems`: what must hold of any settled device: each donor
  once by identity (no two members reach one nbdkit), every placement on a
  live member (the members' slots add up to the units placed times their
  members, and a failed donor holds none), and the bytes each donor keeps
  for the device's export match its placements (at most the extents held
  plus the label's page; nothing on a donor that is not a member).
"""

from __future__ import annotations

LABEL_PAGE = 4096

# field -> type(s) of a device status (`pagerctl status --json`'s "status").
DEVICE_FIELDS = {
    "client_id": str, "mode": str, "code": str, "donors": list, "extent_bytes": int,
    "size_bytes": int, "left": list, "totals": dict, "updated_unix_ms": int,
}
# Fields left out while empty, with their type when present.
OPTIONAL_FIELDS = {"not_admitted": dict, "donors_file_error": str, "discovery_error": str}
DONOR_FIELDS = {
    "name": str, "address": str, "export": str, "failed": bool, "extents_held": int,
    "slots_free": int, "used_bytes": int, "joined": str, "leaving": bool, "state": str,
}
TOTAL_FIELDS = {
    "units": int, "units_placed": int, "lost": int, "lost_extents": list, "degraded": int,
    "rebuild": dict, "drain": dict, "off_fallback": dict, "parity_log_used_bytes": int,
    "fallback_used_bytes": int,
}


def export_key(name: str) -> str:
    """An export's name as a donor keeps it: without the `@SIZE` a client
    asks for, the `~TOKEN` of its client id, the `:GEN` of its session
    (pager-server's `CLIENT[~TOKEN][/DEVICE[:GEN]][@SIZE]`)."""
    name = name.split("@")[0]
    client, slash, device = name.partition("/")
    return client.split("~")[0] + slash + device.split(":")[0]


def export_keys(st: dict) -> set[str]:
    """The exports a device uses (export_key), from its donors' reports
    (its client id when it has no donor)."""
    return {export_key(d["export"]) for d in st["donors"]} or {st["client_id"]}


def _types(where: str, obj, fields: dict) -> list[str]:
    out = []
    if not isinstance(obj, dict):
        return [f"{where}: not an object but {type(obj).__name__}"]
    for k, t in fields.items():
        if k not in obj:
            out.append(f"{where}: no field {k!r}")
        elif not isinstance(obj[k], t) or (t is int and isinstance(obj[k], bool)):
            out.append(f"{where}.{k}: {obj[k]!r} is not {t.__name__}")
    return out


def status_problems(full: dict) -> list[str]:
    """What is wrong with the shape of `pagerctl status --json`'s output."""
    out = _types("status", full, {"attached": bool, "state_dir": str, "status": dict})
    st = full.get("status")
    if not isinstance(st, dict):
        return out
    out += _types("status.status", st, DEVICE_FIELDS)
    out += _types("status.status", st, {k: t for k, t in OPTIONAL_FIELDS.items() if k in st})
    for i, d in enumerate(st.get("donors") or []):
        out += _types(f"status.status.donors[{i}]", d, DONOR_FIELDS)
    out += _types("status.status.totals", st.get("totals"), TOTAL_FIELDS)
    return out


def quiet(st: dict) -> bool:
    """Nothing lost, degraded, rebuilding, draining or moving off the fallback."""
    t = st["totals"]
    return (t["lost"] == 0 and t["degraded"] == 0 and not t["rebuild"]["active"]
            and not t["drain"]["active"] and not t["off_fallback"]["active"])


def settle_problems(st: dict, want: dict) -> list[str]:
    """How device status `st` differs from the model's view `want` of it
    (model.Model.view()[device])."""
    out = []
    donors = {d["name"]: d for d in st["donors"]}
    members = want["members"]
    if set(donors) != set(members):
        out.append(f"donors {sorted(donors)}, the model has {sorted(members)}")
    for n, how in members.items():
        d = donors.get(n)
        if d is None:
            continue
        if d["joined"] != how:
            out.append(f"{n} joined {d['joined']}, the model says {how}")
        if d["failed"] != (n in want["failed"]):
            out.append(f"{n} {'is' if d['failed'] else 'is not'} failed "
                       f"({d.get('failure') or 'no failure'})")
        if d["leaving"]:
            out.append(f"{n} is still leaving")
        if n in want["empty"] and d["extents_held"]:
            out.append(f"{n} holds {d['extents_held']} extents; it must hold none (draining or dead)")
    t = st["totals"]
    if not quiet(st):
        out.append(f"not quiet: lost {t['lost']} {t['lost_extents'][:10]}, degraded {t['degraded']}, "
                   f"rebuild {t['rebuild']}, drain {t['drain']}, off fallback {t['off_fallback']}")
    if "file_bad" in want:
        err = st.get("donors_file_error")
        if want["file_bad"] and not (err and "line " in err):
            out.append(f"the donors file has a bad line and status says {err!r}")
        if not want["file_bad"] and err:
            out.append(f"the donors file is fine and status says {err!r}")
    if "not_admitted" in want:
        ours = {"an", "aw"}
        seen = set(st.get("not_admitted", {})) & ours
        if seen != set(want["not_admitted"]):
            out.append(f"announced and not used: {sorted(seen)} (of ours), the model has "
                       f"{want['not_admitted']}: {st.get('not_admitted')}")
    return out


def placed_members(st: dict) -> int:
    """Members the device's placed units have: home units and parity-log
    units, times the members of each."""
    k, r = (int(x) for x in st["code"].split("+"))
    t = st["totals"]
    log_units = t["parity_log_used_bytes"] // (st["extent_bytes"] * k)
    return (t["units_placed"] + log_units) * (k + r)


def invariant_problems(st: dict, host_of: dict, used: dict, after: dict | None = None) -> list[str]:
    """Invariants of a quiet device. `host_of` maps each donor address in
    the status (HOST:PORT) to the donor process it reaches (its host name:
    two addresses of one host reach one process); `used` maps each running
    donor (host name) to the bytes it keeps for this device's export (None
    where it has no such export), asked after status `st` was written and
    before status `after` (default `st`): a slot the parity log placed and
    wrote in between is in `after`'s count, one it freed in `st`'s."""
    out = []
    donors = st["donors"]
    by_process: dict[str, list[str]] = {}
    for d in donors:
        by_process.setdefault(host_of.get(d["address"], d["address"]), []).append(d["name"])
    for proc, names in by_process.items():
        if len(names) > 1:
            out.append(f"one donor is a member {len(names)} times: {names} all reach {proc}")
    if quiet(st):
        held = sum(d["extents_held"] for d in donors)
        fallback = st["totals"]["fallback_used_bytes"] // st["extent_bytes"]
        want = placed_members(st)
        if held + fallback != want:
            out.append(f"the members' slots add up to {held} (+{fallback} on the fallback) but "
                       f"{st['totals']['units_placed']} units are placed: {want} members")
        for d in donors:
            if d["failed"] and d["extents_held"]:
                out.append(f"failed donor {d['name']} still holds {d['extents_held']} extents")
    held_on: dict[str, int] = {}
    for snapshot in (st, after or st):
        mine: dict[str, int] = {}
        for d in snapshot["donors"]:
            proc = host_of.get(d["address"], d["address"])
            mine[proc] = mine.get(proc, 0) + (0 if d["failed"] else d["extents_held"])
        for proc, n in mine.items():
            held_on[proc] = max(held_on.get(proc, 0), n)
    for proc, u in used.items():
        if u is None:
            continue
        cap = held_on[proc] * st["extent_bytes"] + LABEL_PAGE if proc in held_on else 0
        if u > cap:
            out.append(f"donor {proc} keeps {u} bytes of export {st['client_id']!r} but the device "
                       f"places {held_on.get(proc, 0)} extents there (at most {cap} bytes)")
    return out
