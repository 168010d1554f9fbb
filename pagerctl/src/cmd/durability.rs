//! `pagerctl durability`: the chance of data loss per mode, from
//! `pager_client::durability`.

use anyhow::Context as _;
use pager_client::durability::{self, Inputs, Scheme};

/// The chance of losing data in modes none, mirror, parity and ec, from a
/// donor failure rate and a rebuild time.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Failures per donor per year (crashes, reboots, owners taking the
    /// memory back without a drain).
    #[arg(long, default_value_t = 4.0)]
    pub failures_per_year: f64,
    /// Mean time to rebuild a lost member elsewhere, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub rebuild_secs: f64,
    /// Time over which the chance is given, years.
    #[arg(long, default_value_t = 1.0)]
    pub years: f64,
    /// Donors the device spreads over.
    #[arg(long, default_value_t = 8)]
    pub donors: u32,
    /// Mode parity's width.
    #[arg(long, default_value_t = 3)]
    pub parity_width: u32,
    /// Mode ec's codes, K+R, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4+2", value_parser = parse_code)]
    pub ec: Vec<(u32, u32)>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_code(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{s:?} is not a code K+R (e.g. 4+2)");
    let (k, r) = s.split_once('+').ok_or_else(bad)?;
    let (k, r) = (
        k.trim().parse().map_err(|_| bad())?,
        r.trim().parse().map_err(|_| bad())?,
    );
    if k == 0 || r == 0 {
        return Err(bad());
    }
    Ok((k, r))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let inputs = Inputs {
        failure_rate: args.failures_per_year / 8766.0,
        rebuild_hours: args.rebuild_secs / 3600.0,
        mission_hours: args.years * 8766.0,
        donors: args.donors,
    };
    let mut schemes = vec![
        Scheme::none(),
        Scheme::mirror(),
        Scheme::parity(args.parity_width),
    ];
    schemes.extend(args.ec.iter().map(|&(k, r)| Scheme::ec(k, r)));
    let rows = durability::evaluate(&inputs, &schemes).context("modelling data loss")?;
    if args.json {
        let out = serde_json::json!({ "inputs": inputs, "modes": rows });
        println!(
            "{}",
            serde_json::to_string_pretty(&out).context("encoding JSON")?
        );
    } else {
        print!("{}", durability::to_table(&inputs, &rows));
    }
    Ok(())
}
