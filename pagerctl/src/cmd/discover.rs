//! `pagerctl discover`: the donors announced on the lab's network now
//! (DNS-SD, `pager-server announce=true`, or with `--domain` the records
//! of a DNS domain, `announce=dns`), each checked as `attach
//! --discover` checks it: with the lab key its signed status must verify,
//! without one only loopback and --trust-network count.

use std::time::{Duration, Instant};

use anyhow::Result;
use netpager_membership::discovery::{self, Announced, Network, Sources, Trust};

use super::{parse_secs, EndpointArgs};

#[derive(clap::Args)]
pub struct Args {
    /// How long to listen for announcements.
    #[arg(long = "for", default_value = "3", value_parser = parse_secs, value_name = "SECS")]
    listen: Duration,
    /// Return as soon as these nodes are seen (repeat), at the latest after --for.
    #[arg(long, value_name = "NODE")]
    expect: Vec<String>,
    /// Browse this DNS domain (`_netpager._tcp.DOMAIN`) instead of the
    /// local segment. Repeat.
    #[arg(long, value_name = "DOMAIN")]
    domain: Vec<String>,
    /// The DNS server asked for --domain (default: the system resolver's).
    #[arg(long, value_name = "ADDR[:PORT]", requires = "domain")]
    dns_server: Option<String>,
    /// Without --psk: a network (ADDR/BITS) whose donors count as usable
    /// unverified, besides loopback (attach --trust-network). Repeat.
    #[arg(long, value_name = "CIDR")]
    trust_network: Vec<Network>,
    /// Without --psk: donors anywhere count as usable unverified.
    #[arg(long)]
    insecure: bool,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    endpoint: EndpointArgs,
}

/// One announced donor and whether a device would use it.
struct Row {
    a: Announced,
    usable: Result<&'static str, String>,
}

pub fn run(args: Args) -> Result<()> {
    let client = args.endpoint.client()?;
    let server = args
        .dns_server
        .as_deref()
        .map(netpager_membership::dns::parse_server)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let mut sources = Sources::start(args.domain.is_empty(), &args.domain, server, client.timeout)
        .map_err(anyhow::Error::msg)?;
    let start = Instant::now();
    let mut round = sources.round();
    while start.elapsed() < args.listen
        && (args.expect.is_empty()
            || !args
                .expect
                .iter()
                .all(|n| round.announced.iter().any(|a| &a.node_id == n)))
    {
        std::thread::sleep(Duration::from_millis(100));
        round = sources.round();
    }
    drop(sources);
    let (seen, errors) = (round.announced, round.errors);
    for e in &errors {
        eprintln!("pagerctl discover: {e}");
    }
    let trust = Trust {
        networks: args.trust_network.clone(),
        insecure: args.insecure,
    };
    let mut rows: Vec<Row> = seen
        .into_iter()
        .map(|a| Row {
            usable: discovery::check(&client, &a, &trust),
            a,
        })
        .collect();
    // Records past their lease (watched for one lease: --for longer than it).
    rows.extend(round.expired.into_iter().map(|e| Row {
        a: e.a,
        usable: Err(e.why),
    }));
    if args.json {
        let v: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "node_id": r.a.node_id,
                    "nbd": r.a.nbd.to_string(),
                    "status": r.a.status.to_string(),
                    "usable": r.usable.is_ok(),
                    "why": match &r.usable { Ok(w) => w.to_string(), Err(e) => e.clone() },
                    "spec": r.a.spec_line(),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("{}", render(&rows));
    }
    Ok(())
}

fn render(rows: &[Row]) -> String {
    if rows.is_empty() {
        return "no donor announced (pager-server announce=true or announce=dns)".into();
    }
    let cells: Vec<[String; 5]> = rows
        .iter()
        .map(|r| {
            let (use_, why) = match &r.usable {
                Ok(w) => ("yes", w.to_string()),
                Err(e) => ("no", e.clone()),
            };
            [
                r.a.node_id.clone(),
                r.a.nbd.to_string(),
                r.a.status.to_string(),
                use_.to_string(),
                why,
            ]
        })
        .collect();
    let head = ["node", "nbd", "status", "use", "why"];
    let w: Vec<usize> = (0..4)
        .map(|i| {
            cells
                .iter()
                .map(|c| c[i].len())
                .max()
                .unwrap_or(0)
                .max(head[i].len())
        })
        .collect();
    let line = |c: [&str; 5]| {
        format!(
            "{:<w0$}  {:<w1$}  {:<w2$}  {:<w3$}  {}",
            c[0],
            c[1],
            c[2],
            c[3],
            c[4],
            w0 = w[0],
            w1 = w[1],
            w2 = w[2],
            w3 = w[3]
        )
    };
    let mut out = vec![line(head)];
    out.extend(
        cells
            .iter()
            .map(|c| line([&c[0], &c[1], &c[2], &c[3], &c[4]])),
    );
    out.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_says_which_donors_a_device_would_use_and_why() {
        let a = |node: &str, ip: &str| Announced {
            node_id: node.into(),
            nbd: format!("{ip}:10809").parse().unwrap(),
            status: format!("{ip}:10810").parse().unwrap(),
        };
        let rows = vec![
            Row {
                a: a("idle1", "10.213.47.11"),
                usable: Ok("verified with the lab key"),
            },
            Row {
                a: a("stranger", "10.213.47.12"),
                usable: Err("status not verified with the lab key: bad MAC".into()),
            },
        ];
        let t = render(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("node      nbd"), "{t}");
        assert!(
            lines[1].starts_with("idle1     10.213.47.11:10809  10.213.47.11:10810  yes  verified"),
            "{t}"
        );
        assert!(lines[2].contains("  no   status not verified"), "{t}");
        assert!(render(&[]).contains("no donor announced"));
    }
}
