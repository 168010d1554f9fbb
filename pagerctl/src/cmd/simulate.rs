//! `pagerctl simulate`: runs the donor-selection simulation of
//! `pagerctl::sim` and prints its table or JSON.

use anyhow::Context as _;
use pagerctl::sim::{self, ClusterShape, SimConfig};

/// Simulate donor selection: load skew and deviation from global LRU for
/// the weighted rule at several load-balancing rates b, and for
/// round-robin, random, power-of-two-choices and hash placement.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Number of donors (memory servers).
    #[arg(long, default_value_t = 8)]
    pub donors: usize,
    /// Number of clients placing pages.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Number of epochs (status periods); donor 0 turns idle after a third
    /// (shape join: the last donor joins then).
    #[arg(long, default_value_t = 60)]
    pub epochs: u32,
    /// Load-balancing rates to simulate, comma-separated.
    #[arg(
        long = "b",
        value_delimiter = ',',
        default_value = "0,0.25,0.5,0.75,0.9,1"
    )]
    pub b: Vec<f64>,
    /// Which donors the simulated cluster has.
    #[arg(long, value_enum, default_value_t = ClusterShape::Mixed)]
    pub shape: ClusterShape,
    /// Mean service time S of one request at a donor, microseconds.
    #[arg(long, default_value_t = 100.0)]
    pub service_us: f64,
    /// Do not borrow donors' unused capacity (Voelker's thesis §3.6.2).
    #[arg(long)]
    pub no_borrowing: bool,
    /// Seed of the simulation's random choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let report = sim::run(&config(&args)).context("simulating donor selection")?;
    if args.json {
        println!(
            "{}",
            report.to_json().context("encoding the report as JSON")?
        );
    } else {
        print!("{}", report.to_table());
    }
    Ok(())
}

fn config(args: &Args) -> SimConfig {
    SimConfig {
        donors: args.donors,
        clients: args.clients,
        epochs: args.epochs,
        b_values: args.b.clone(),
        seed: args.seed,
        idle_epoch: args.epochs / 3,
        shape: args.shape,
        service_time_s: args.service_us / 1e6,
        borrowing: !args.no_borrowing,
        ..SimConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(argv: &[&str]) -> Args {
        Cli::try_parse_from(std::iter::once("simulate").chain(argv.iter().copied()))
            .expect("valid command line")
            .args
    }

    #[test]
    fn command_line_becomes_a_config() {
        let c = config(&parse(&[
            "--b",
            "0,0.5",
            "--epochs",
            "30",
            "--shape",
            "uniform",
            "--service-us",
            "250",
            "--no-borrowing",
        ]));
        assert_eq!(c.b_values, vec![0.0, 0.5]);
        assert_eq!((c.epochs, c.idle_epoch), (30, 10));
        assert_eq!(c.shape, ClusterShape::Uniform);
        assert!((c.service_time_s - 250e-6).abs() < 1e-12);
        assert!(!c.borrowing);
        let defaults = config(&parse(&[]));
        assert_eq!(defaults.b_values, vec![0.0, 0.25, 0.5, 0.75, 0.9, 1.0]);
        assert!(defaults.borrowing);
    }

    #[test]
    fn bad_b_is_reported() {
        let err = run(parse(&["--b", "0.5,1.5"])).unwrap_err();
        assert!(format!("{err:#}").contains("b = 1.5"), "{err:#}");
    }
}
