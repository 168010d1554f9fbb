//! netpager-token: prints a client's export name prefix `CLIENT~TOKEN` for
//! donors started with `export-secret=SECRET_FILE` (see SECURITY.md).
//!
//!     netpager-token SECRET_FILE CLIENT
//!
//! Admins (or Ansible) run it and hand the line to the client, which asks
//! donors for `CLIENT~TOKEN@SIZE`; the secret itself stays off clients.
//!
//!     netpager-token --metrics PSK_FILE
//!
//! prints the bearer token that opens `/metrics` endpoints keyed with the
//! lab key of PSK_FILE (`user:hexkey`), for Prometheus's credentials file.

use std::path::Path;

use anyhow::{bail, Context, Result};
use netpager_proto::auth::{export_token, load_export_secret};
use netpager_proto::LabKey;

const USAGE: &str = "usage: netpager-token SECRET_FILE CLIENT\n\
prints CLIENT~TOKEN, the export name (before any @SIZE) that donors started\n\
with export-secret=SECRET_FILE open for CLIENT\n\
usage: netpager-token --metrics PSK_FILE\n\
prints the bearer token of /metrics endpoints keyed with PSK_FILE's lab key\n\
usage: netpager-token --version";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return Ok(());
    }
    if args.iter().any(|a| a == "-V" || a == "--version") {
        println!("netpager-token {}", netpager_util::version!());
        return Ok(());
    }
    if let [flag, psk] = args.as_slice() {
        if flag == "--metrics" {
            let key = LabKey::from_psk_file(Path::new(psk), None).context("loading the lab key")?;
            println!("{}", key.metrics_token());
            return Ok(());
        }
    }
    let [secret_file, client] = args.as_slice() else {
        bail!("expected 2 arguments, got {}\n{USAGE}", args.len());
    };
    check_client(client)?;
    let secret = load_export_secret(Path::new(secret_file)).context("loading the export secret")?;
    println!("{client}~{}", export_token(&secret, client));
    Ok(())
}

/// The donor's rule for the CLIENT part of an export name, so a name this
/// tool prints is one the donor accepts.
fn check_client(client: &str) -> Result<()> {
    if client.is_empty() || client.len() > 64 {
        bail!("client {client:?}: must be 1 to 64 characters");
    }
    if let Some(c) = client
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        bail!("client {client:?}: character {c:?} not allowed (use A-Z a-z 0-9 . _ -)");
    }
    if !client.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        bail!("client {client:?}: must start with a letter or digit");
    }
    Ok(())
}
