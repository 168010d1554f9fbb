//! `pagerctl psk`: makes the lab key file, right for both sides. Donors
//! (nbdkit `--tls-psk=`, pager-server `psk=`) and clients (`--psk`) take
//! the same file: a line `IDENTITY:HEXKEY` for the lab identity first
//! (status requests and replies are signed with its key), then one for
//! every client id, because a client presents its id as its TLS identity.
//! Every line holds the one key.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use netpager_proto::auth;
use netpager_util::defaults;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Make a new lab key file (mode 0600; an existing file is never
    /// overwritten): the lab identity's line, then one per --client.
    New {
        /// The file (default /etc/netpager/netpager.psk).
        #[arg(value_name = "FILE")]
        file: Option<PathBuf>,
        /// A client id that will use the key (its TLS identity; pagerctl
        /// attach's --client-id, by default the client's host name).
        /// Repeat; default this host's name.
        #[arg(long = "client", value_name = "ID")]
        clients: Vec<String>,
        /// The file's first identity (default netpager).
        #[arg(long, value_name = "NAME")]
        identity: Option<String>,
    },
    /// Add client ids to a lab key file, with its key (the same lines must
    /// go to every donor's copy).
    Add {
        #[arg(value_name = "FILE")]
        file: PathBuf,
        #[arg(value_name = "ID", required = true)]
        clients: Vec<String>,
    },
}

pub fn run(a: Args) -> Result<()> {
    match a.what {
        What::New {
            file,
            clients,
            identity,
        } => {
            let file = file.unwrap_or_else(|| PathBuf::from(defaults::LAB_KEY_FILE));
            let clients = if clients.is_empty() {
                vec![super::host_name()]
            } else {
                clients
            };
            let first = identity.unwrap_or_else(|| defaults::LAB_KEY_IDENTITY.to_string());
            let mut ids = vec![first.as_str()];
            ids.extend(clients.iter().map(String::as_str));
            let text = auth::new_psk_file_text(&ids).map_err(anyhow::Error::msg)?;
            write(&file, &text, true)?;
            println!(
                "wrote {} (identities {}): give the same file to every donor (nbdkit --tls-psk= and pager-server psk=) and every client (pagerctl attach --psk)",
                file.display(),
                ids.join(", ")
            );
        }
        What::Add { file, clients } => {
            let ids: Vec<&str> = clients.iter().map(String::as_str).collect();
            let text = auth::psk_lines_to_add(&file, &ids).map_err(anyhow::Error::msg)?;
            if text.is_empty() {
                println!("{} has a line for each of them already", file.display());
                return Ok(());
            }
            write(&file, &text, false)?;
            println!(
                "added {} to {}: copy the file to every donor too (nbdkit reads it at each handshake)",
                text.lines()
                    .filter_map(|l| l.split(':').next())
                    .collect::<Vec<_>>()
                    .join(", "),
                file.display()
            );
        }
    }
    Ok(())
}

/// Writes a new file (mode 0600, never over an existing one) or appends.
fn write(path: &Path, text: &str, new: bool) -> Result<()> {
    let mut o = std::fs::OpenOptions::new();
    if new {
        o.write(true).create_new(true).mode(0o600);
    } else {
        o.append(true);
    }
    let mut f = o.open(path).with_context(|| {
        if new && path.exists() {
            format!(
                "{} exists: a new lab key would lock out everyone holding the old one; to add clients use pagerctl psk add",
                path.display()
            )
        } else {
            format!("cannot write {}", path.display())
        }
    })?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", path.display()))
}
