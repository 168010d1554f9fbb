"""Observability with the real parts (issue 17): Debian's Prometheus scrapes
two donors, a client and prefetchd on loopback and its HTTP API shows the
series exist and move; `promtool check metrics` accepts every endpoint's
output; the alert rules load and fire; `pagerctl top` runs in tmux.

Prometheus is our own process (temporary config and data directory, a
loopback port), never the package's service, and stopped by pid.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from netpager_testkit.client import PagerClient, donor_spec
from netpager_testkit import OwnedProcess, Teardown, repo_root, target_dir, wait_for
from netpager_testkit.ci import skip_or_fail
from netpager_testkit.donor import free_ports
from netpager_testkit.machine import loopback
from netpager_testkit.prefetch import Prefetchd

RULES = repo_root() / "ansible" / "roles" / "monitoring" / "files" / "netpager-alerts.yml"
MIB = 1 << 20


def need(*tools: str) -> None:
    for t in tools:
        if shutil.which(t) is None:
            skip_or_fail(f"{t} missing (scripts/deps.sh installs it)")


def need_built(*names: str) -> None:
    for n in names:
        if not (target_dir() / n).exists():
            skip_or_fail(f"{target_dir() / n} missing (run `make build`)")


def http_get(url: str, headers: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def check_metrics(url: str) -> str:
    """The endpoint's text format, which promtool must accept."""
    status, body = http_get(url)
    assert status == 200, f"{url}: {status} {body[:500]}"
    p = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, f"promtool check metrics {url}:\n{p.stdout}{p.stderr}"
    return body


class Prometheus:
    """`prometheus` scraping `targets` ({role: [HOST:PORT]}) every second."""

    def __init__(self, td: Teardown, workdir: Path, targets: dict[str, list[str]]):
        self.addr = loopback(1)
        self.port = free_ports(self.addr, 1)[0]
        self.url = f"http://{self.addr}:{self.port}"
        cfg = workdir / "prometheus.yml"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{
                "job_name": "netpager",
                "static_configs": [{"targets": t, "labels": {"netpager_role": role}}
                                   for role, t in targets.items()],
            }],
        }
        cfg.write_text(json.dumps(config, indent=2) + "\n")
        argv = ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address={self.addr}:{self.port}"]
        self.proc = OwnedProcess(argv, workdir / "prometheus.log", td, "prometheus")
        wait_for(lambda: self._ready(), 60, "prometheus ready", interval=0.2)

    def _ready(self) -> bool:
        if not self.proc.alive():
            raise RuntimeError(f"prometheus exited; see {self.proc.log_path}")
        try:
            return http_get(self.url + "/-/ready")[0] == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict]:
        status, body = http_get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert status == 200, f"{expr}: {status} {body}"
        return json.loads(body)["data"]["result"]

    def value(self, expr: str) -> float | None:
        r = self.query(expr)
        return float(r[0]["value"][1]) if r else None

    def wait_value(self, expr: str, pred, what: str, timeout: float = 60) -> float:
        last = None

        def check():
            nonlocal last
            last = self.value(expr)
            return last is not None and pred(last)

        try:
            wait_for(check, timeout, what, interval=0.5)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; {expr} = {last}") from None
        return last


def test_prometheus_scrapes_every_endpoint_and_the_series_move(root, teardown, cluster, tmp_path):
    need("prometheus", "promtool")
    need_built("pagerctl", "prefetchd", "libpager_client_plugin.so")
    addrs = [loopback(2), loopback(3)]
    metrics = [f"{a}:{free_ports(a, 1)[0]}" for a in addrs]
    donors = cluster.start_donors(2, budgets="256M", size="1G", poll_ms=100,
                                  metrics=metrics)
    client_ep = f"{loopback(1)}:{free_ports(loopback(1), 1)[0]}"
    client = PagerClient(teardown, tmp_path / "state")
    device = client.attach(donors, mode="mirror", size="64M", extra=["--metrics", client_ep])
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(bytes(range(256)) * 4096)
    pf_ep = f"{loopback(1)}:{free_ports(loopback(1), 1)[0]}"
    pd = Prefetchd(teardown, tmp_path, data, extra=["--metrics", pf_ep, "--no-mlock"])

    endpoints = {"donor": metrics, "client": [client_ep], "prefetchd": [pf_ep]}
    for ep in [e for eps in endpoints.values() for e in eps]:
        check_metrics(f"http://{ep}/metrics")
    prom = Prometheus(teardown, tmp_path, endpoints)
    prom.wait_value('count(up{job="netpager"} == 1)', lambda v: v == 4, "all four targets up")
    for series in ("netpager_donor_budget_bytes", 'netpager_donor_state{state="idle"}',
                   "netpager_donor_page_age_seconds", "netpager_donor_service_seconds_bucket",
                   "netpager_client_donor_frequency", 'netpager_client_frontend{frontend!=""}',
                   'netpager_client_request_seconds_bucket{op="write"}',
                   'netpager_client_background_active{activity="rebuild"}',
                   "netpager_prefetch_local_blocks"):
        assert prom.query(series), f"no series {series}"

    # A job writes through the device: the byte counters rise.
    donor_written = "sum(netpager_donor_written_bytes_total)"
    client_written = 'netpager_client_request_bytes_total{op="write"}'
    d0 = prom.wait_value(donor_written, lambda v: True, "donor counters scraped")
    c0 = prom.wait_value(client_written, lambda v: True, "client counters scraped")
    subprocess.run(["dd", "if=/dev/urandom", f"of={device}", "bs=1M", "count=16", "oflag=direct",
                    "conv=fsync", "status=none"], check=True, timeout=120)
    # Mirror: each byte goes to both donors.
    prom.wait_value(donor_written, lambda v: v >= d0 + 32 * MIB, "donors' written bytes rise")
    prom.wait_value(client_written, lambda v: v >= c0 + 16 * MIB, "client's written bytes rise")
    assert prom.value("sum(netpager_donor_used_bytes)") > 0
    with open(pd.mount / "data" / "a.bin", "rb") as f:
        assert f.read() == bytes(range(256)) * 4096
    prom.wait_value('sum(netpager_prefetch_reads_total{prefetch_job="(unhinted)"})', lambda v: v > 0,
                    "prefetchd's reads rise")

    # A donor dies: the client runs degraded (mirror, nowhere to rebuild),
    # and the alert on it goes pending.
    assert prom.value("netpager_client_degraded") == 0
    donors[0].kill9()
    prom.wait_value("netpager_client_degraded", lambda v: v == 1, "degraded gauge goes to 1")
    prom.wait_value('netpager_client_donor_failed{donor="d1"}', lambda v: v == 1, "d1 marked failed")
    prom.wait_value('count(ALERTS{alertname="NetpagerClientDegraded"})', lambda v: v == 1,
                    "the degraded alert is pending")
    status, body = http_get(prom.url + "/api/v1/rules")
    rules = [r for g in json.loads(body)["data"]["groups"] for r in g["rules"]]
    in_file = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert len(rules) == len(in_file) and all(r["health"] == "ok" for r in rules), rules
    # The survivors' endpoints still pass promtool.
    for ep in [metrics[1], client_ep, pf_ep]:
        check_metrics(f"http://{ep}/metrics")


def test_keyed_and_network_endpoints(teardown, cluster, tmp_path):
    need_built("netpager-token")
    psk = tmp_path / "lab.psk"
    psk.write_text("lab:00112233445566778899aabbccddeeff\n")
    ep = f"{loopback(2)}:{free_ports(loopback(2), 1)[0]}"
    cluster.start_donors(1, budgets="64M", size="64M", metrics=ep, psk=str(psk))
    url = f"http://{ep}/metrics"
    assert http_get(url)[0] == 401
    assert http_get(url, {"Authorization": "Bearer " + "00" * 32})[0] == 401
    token = subprocess.run([str(target_dir() / "netpager-token"), "--metrics", str(psk)],
                           capture_output=True, text=True, check=True).stdout.strip()
    status, body = http_get(url, {"Authorization": f"Bearer {token}"})
    assert status == 200 and "netpager_donor_budget_bytes 67108864" in body, body[:500]
    # A network address without the key (or insecure=true) stops the start.
    open_ep = f"0.0.0.0:{free_ports(loopback(1), 1)[0]}"
    with pytest.raises(RuntimeError) as e:
        cluster.start_donors(1, budgets="64M", size="64M", metrics=open_ep)
    assert "insecure=true" in str(e.value) or "insecure=true" in cluster[-1].log_tail(), str(e.value)


def test_top_shows_the_client_in_tmux(root, teardown, cluster, tmp_path):
    need("tmux")
    need_built("pagerctl", "libpager_client_plugin.so")
    donors = cluster.start_donors(2, budgets="256M", size="1G", poll_ms=100)
    client = PagerClient(teardown, tmp_path / "state")
    device = client.attach(donors, mode="mirror", size="64M")
    session = f"netpager-top-{tmp_path.name}"[:60]
    # Our own tmux server (its socket under tmp_path), so that nothing else
    # of the machine's tmux is touched.
    sock = tmp_path / "tmux.sock"
    tmux = ["tmux", "-S", str(sock)]
    top = f"{target_dir() / 'pagerctl'} top --state-dir {client.state_dir}"
    subprocess.run(tmux + ["new-session", "-d", "-s", session, "-x", "150", "-y", "40", top],
                   check=True, timeout=30)
    teardown.add(f"tmux server {sock}",
                 lambda: subprocess.run(tmux + ["kill-server"], capture_output=True, timeout=30))

    def screen() -> str:
        return subprocess.run(tmux + ["capture-pane", "-p", "-t", session], capture_output=True,
                              text=True, timeout=30).stdout

    wait_for(lambda: "netpager top" in screen(), 30, "pagerctl top draws")
    subprocess.run(["dd", "if=/dev/urandom", f"of={device}", "bs=1M", "count=16", "oflag=direct",
                    "conv=fsync", "status=none"], check=True, timeout=120)
    # 16 MiB in 1 MiB extents, mirrored: 16 units, 16 copies on each donor.
    wait_for(lambda: "placed 16/64 units" in screen(), 30, "top shows the placed units")
    text = screen()
    assert [line.split()[2] for line in text.splitlines() if line.startswith(("│d1 ", "│d2 "))] \
        == ["16", "16"], text
    for want in (f"client {client.client_id}", "mode mirror (1+1)", "Requests", "Donors", "d1", "d2",
                 "Rebuild", "Drain", "healthy"):
        assert want in text, f"{want!r} missing from the screen:\n{text}"
    donors[0].kill9()
    wait_for(lambda: "FAILED" in screen() and "DEGRADED" in screen(), 60,
             "top shows the failed donor and the degraded device")
    subprocess.run(tmux + ["send-keys", "-t", session, "q"], check=True, timeout=30)
    wait_for(lambda: subprocess.run(tmux + ["has-session", "-t", session], capture_output=True,
                                    timeout=30).returncode != 0, 10, "top quits on q")


def test_the_nbd_front_end_serves_client_metrics_too(root, teardown, cluster, tmp_path):
    """With --frontend nbd the device lives in the client's nbdkit, which
    serves /metrics itself."""
    need("promtool")
    need_built("pagerctl", "libpager_client_plugin.so")
    donors = cluster.start_donors(2, budgets="256M", size="1G", poll_ms=100)
    ep = f"{loopback(1)}:{free_ports(loopback(1), 1)[0]}"
    client = PagerClient(teardown, tmp_path / "state")
    client.attach(donors, mode="mirror", size="64M", frontend="nbd", extra=["--metrics", ep])
    body = check_metrics(f"http://{ep}/metrics")
    assert 'netpager_client_frontend{frontend="nbd",transport=""} 1' in body, body[:2000]
    for d in ("d1", "d2"):
        assert f'netpager_client_donor_failed{{donor="{d}"}} 0' in body, body[:2000]
