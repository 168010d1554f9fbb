//! prefetchd follows the same membership as a client's device (the crate
//! `netpager-membership`): donors come from `--donor` (fixed), from a
//! donors file re-read while the daemon runs (`--donors-file`, one
//! `--donor` value a line) and from discovery on the lab's network
//! (`--discover`). A line added starts a lane; a line removed lets the
//! donor go as a draining donor is let go (its blocks dropped, its export
//! trimmed). A discovered donor joins once its status, signed with the lab
//! key, verifies; one that stops announcing is not removed for that alone.
//!
//! The decisions are pure ([`parse_donors_file`], [`changes`],
//! [`discovered_arg`]); [`Watcher`] applies them to the lanes
//! ([`crate::lanes`]) each status-poll period.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use netpager_membership::discovery::{self, Admission, Announced, Network, Trust, Verdict};
use netpager_membership::{parse_lines, DonorsFileError};
use netpager_nbd::Endpoint;

use crate::donor::DonorArg;
use crate::lanes::{status_client, Lanes, Source};

/// Discovery's settings (`--discover`, `--discover-domain`).
#[derive(Debug, Clone)]
pub struct Discover {
    /// Browse the local segment (multicast DNS).
    pub mdns: bool,
    /// DNS domains browsed, and the server asked (else the resolver's).
    pub domains: Vec<String>,
    pub dns_server: Option<std::net::SocketAddr>,
    /// The lab key: TLS to discovered donors, and their status must verify.
    pub psk: Option<PathBuf>,
    /// The user name of the key in `psk` (its first line's).
    pub user: Option<String>,
    /// The export prefetchd uses on a discovered donor.
    pub export: String,
    /// Use discovered donors beyond loopback and `trust_network` without a key.
    pub insecure: bool,
    /// Networks whose announced donors are used without a key, besides loopback.
    pub trust_network: Vec<Network>,
}

/// Where the set's changes come from.
#[derive(Debug, Clone, Default)]
pub struct Config {
    pub donors_file: Option<PathBuf>,
    pub discover: Option<Discover>,
}

/// A donor's name: its memory endpoint (as its lane is named).
pub fn donor_name(arg: &DonorArg) -> String {
    format!("{}/{}", arg.memory.addr(), arg.memory.export)
}

/// Parses a donors file: one `--donor` value a line, `#` comments.
pub fn parse_donors_file(path: &Path, text: &str) -> Result<Vec<DonorArg>, DonorsFileError> {
    parse_lines(
        path,
        text,
        |l| l.parse::<DonorArg>().map_err(|e| crate::error_chain(&e)),
        donor_name,
    )
}

/// What turns the file's donors in the set (`applied`: name and argument)
/// into the file's new donors (`wanted`).
#[derive(Debug, Default, PartialEq)]
pub struct Changes {
    pub add: Vec<DonorArg>,
    /// Names. A line changed in place is removed and added again: its lane's
    /// blocks were placed under the old options.
    pub remove: Vec<String>,
}

pub fn changes(applied: &[(String, DonorArg)], wanted: &[DonorArg]) -> Changes {
    let mut c = Changes::default();
    for (name, arg) in applied {
        if !wanted.contains(arg) {
            c.remove.push(name.clone());
        }
    }
    for w in wanted {
        if !applied.iter().any(|(_, a)| a == w) {
            c.add.push(w.clone());
        }
    }
    c
}

/// The donor argument for an announced donor.
pub fn discovered_arg(a: &Announced, d: &Discover) -> DonorArg {
    DonorArg {
        memory: Endpoint {
            host: a.nbd.ip().to_string(),
            port: a.nbd.port(),
            export: d.export.clone(),
            tls_psk_file: d.psk.clone(),
            tls_username: d.user.clone(),
        },
        replica: None,
        slots: None,
        status: Some(a.status.to_string()),
    }
}

/// Logs a message the first time, and again only when it changes, so a
/// bad file or a stranger's announcement is said once, not every period.
#[derive(Default)]
struct Said(HashMap<String, String>);

impl Said {
    fn warn(&mut self, key: &str, msg: String) {
        if self.0.get(key) != Some(&msg) {
            tracing::warn!("{msg}");
            self.0.insert(key.to_string(), msg);
        }
    }

    fn clear(&mut self, key: &str) {
        self.0.remove(key);
    }
}

/// Why following the donors file and discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    #[error("discovery: {0}")]
    Sources(String),
    /// The membership thread did not start.
    #[error(transparent)]
    Thread(#[from] std::io::Error),
}

/// Applies the donors file's and discovery's changes to the running set.
pub(crate) struct Watcher {
    cfg: Config,
    /// Checks announced donors on a thread of its own.
    admission: Option<Admission>,
    said: Said,
}

impl Watcher {
    /// `connect`: the status query's timeout; `period`: how often the
    /// announcements are looked at.
    pub(crate) fn new(
        cfg: Config,
        connect: std::time::Duration,
        period: std::time::Duration,
    ) -> Result<Watcher, MembershipError> {
        let admission = match &cfg.discover {
            None => None,
            Some(disc) => {
                let mut sources =
                    discovery::Sources::start(disc.mdns, &disc.domains, disc.dns_server, connect)
                        .map_err(MembershipError::Sources)?;
                let disc = disc.clone();
                let trust = Trust {
                    networks: disc.trust_network.clone(),
                    insecure: disc.insecure,
                };
                let check = move |a: &Announced| -> Verdict {
                    let client = status_client(&discovered_arg(a, &disc), connect)
                        .map_err(|e| crate::error_chain(&e))?;
                    discovery::check(&client, a, &trust)
                };
                Some(Admission::start(
                    move || {
                        let (found, errors) = sources.announced();
                        for e in &errors {
                            tracing::warn!("discovery: {e}");
                        }
                        (found, errors)
                    },
                    check,
                    period,
                )?)
            }
        };
        Ok(Watcher {
            cfg,
            admission,
            said: Said::default(),
        })
    }

    /// One pass: the donors file, then the announced donors admitted.
    pub(crate) fn pass(&mut self, lanes: &Arc<Lanes>) {
        if let Some(path) = self.cfg.donors_file.clone() {
            self.follow_file(lanes, &path);
        }
        if let (Some(adm), Some(disc)) = (&self.admission, &self.cfg.discover) {
            for (a, verdict) in adm.verdicts() {
                consider(&mut self.said, lanes, adm, &a, verdict, disc);
            }
        }
    }

    fn follow_file(&mut self, lanes: &Arc<Lanes>, path: &Path) {
        let wanted = match std::fs::read_to_string(path)
            .map_err(|source| DonorsFileError::Read {
                path: path.to_path_buf(),
                source,
            })
            .and_then(|text| parse_donors_file(path, &text))
        {
            Ok(w) => {
                self.said.clear("file");
                w
            }
            Err(e) => {
                self.said.warn(
                    "file",
                    format!("donors file not taken, nothing changes: {e}"),
                );
                return;
            }
        };
        let applied: Vec<(usize, String, DonorArg)> = lanes
            .members()
            .iter()
            .enumerate()
            .filter(|(_, m)| m.source == Source::File && !m.removed)
            .map(|(i, m)| (i, donor_name(&m.arg), m.arg.clone()))
            .collect();
        let by_name: Vec<(String, DonorArg)> = applied
            .iter()
            .map(|(_, n, a)| (n.clone(), a.clone()))
            .collect();
        let c = changes(&by_name, &wanted);
        for name in &c.remove {
            if let Some((i, _, _)) = applied.iter().find(|(_, n, _)| n == name) {
                tracing::info!("donor {name}: its line left the donors file; letting it go");
                lanes.remove_member(*i);
            }
        }
        for arg in c.add {
            let name = donor_name(&arg);
            match lanes.add_member(arg, Source::File) {
                Ok(_) => self.said.clear(&name),
                // Retried next period: the donor may not be up yet.
                Err(e) => self.said.warn(
                    &name,
                    format!(
                        "donor {name} (donors file): not joined yet: {}",
                        crate::error_chain(&e)
                    ),
                ),
            }
        }
    }
}

/// Joins an admitted announced donor, or says (once) why not.
fn consider(
    said: &mut Said,
    lanes: &Arc<Lanes>,
    adm: &Admission,
    a: &Announced,
    verdict: Verdict,
    disc: &Discover,
) {
    let arg = discovered_arg(a, disc);
    let name = donor_name(&arg);
    if lanes.members().iter().any(|m| donor_name(&m.arg) == name) {
        return;
    }
    let key = format!("announced {}", a.node_id);
    match verdict {
        Ok(why) => match lanes.add_member(arg, Source::Discovered) {
            Ok(_) => {
                tracing::info!("donor {} ({name}) discovered: {why}", a.node_id);
                said.clear(&key);
            }
            Err(e) => {
                let e = crate::error_chain(&e);
                adm.not_added(&a.node_id, e.clone());
                said.warn(
                    &key,
                    format!(
                        "discovered donor {} ({name}): not joined yet: {e}",
                        a.node_id
                    ),
                )
            }
        },
        Err(why) => said.warn(
            &key,
            format!("discovered donor {} not used: {why}", a.node_id),
        ),
    }
}

/// Starts the thread that follows the donors file and discovery, one pass
/// at once and then one each status-poll period; the lanes join it when
/// they stop.
pub(crate) fn start(cfg: Config, lanes: &Arc<Lanes>) -> Result<(), MembershipError> {
    if cfg.donors_file.is_none() && cfg.discover.is_none() {
        return Ok(());
    }
    let mut w = Watcher::new(cfg, lanes.connect_timeout(), lanes.poll)?;
    let l = lanes.clone();
    let t = std::thread::Builder::new()
        .name("membership".into())
        .spawn(move || {
            w.pass(&l);
            while !l.sleep(l.poll) {
                w.pass(&l);
            }
        })?;
    lanes.keep_thread(t);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    fn arg(s: &str) -> DonorArg {
        s.parse().unwrap()
    }

    fn named(args: &[&str]) -> Vec<(String, DonorArg)> {
        args.iter().map(|s| (donor_name(&arg(s)), arg(s))).collect()
    }

    #[test]
    fn donors_file_lines_are_donor_args_and_bad_lines_are_numbered() {
        let p = Path::new("/etc/netpager/prefetchd.donors");
        let ds = parse_donors_file(
            p,
            "# donors\n127.0.0.2:10809/pf@64M,status=127.0.0.2:7070\n\n127.0.0.3:10809/pf,slots=8 # d3\n",
        )
        .unwrap();
        assert_eq!(
            ds,
            vec![
                arg("127.0.0.2:10809/pf@64M,status=127.0.0.2:7070"),
                arg("127.0.0.3:10809/pf,slots=8")
            ]
        );
        let e = parse_donors_file(p, "127.0.0.2:10809/pf\n127.0.0.3:10809/pf,slots=x\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("prefetchd.donors, line 2") && e.contains("bad slots"),
            "{e}"
        );
        let e = parse_donors_file(p, "127.0.0.2:1/pf\n127.0.0.2:1/pf,slots=4\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 2") && e.contains("already on line 1"),
            "{e}"
        );
    }

    #[test]
    fn changes_add_remove_and_replace_a_changed_line() {
        let applied = named(&["127.0.0.2:1/pf", "127.0.0.3:1/pf", "127.0.0.4:1/pf"]);
        let wanted = vec![
            arg("127.0.0.3:1/pf"),
            arg("127.0.0.4:1/pf,slots=8"),
            arg("127.0.0.5:1/pf"),
        ];
        let c = changes(&applied, &wanted);
        assert_eq!(
            c.remove,
            vec!["127.0.0.2:1/pf".to_string(), "127.0.0.4:1/pf".to_string()]
        );
        assert_eq!(
            c.add,
            vec![arg("127.0.0.4:1/pf,slots=8"), arg("127.0.0.5:1/pf")]
        );
        assert_eq!(
            changes(&named(&["127.0.0.3:1/pf"]), &[arg("127.0.0.3:1/pf")]),
            Changes::default()
        );
    }

    #[test]
    fn a_discovered_donor_uses_the_lab_key_and_its_status_endpoint() {
        let a = Announced {
            node_id: "idle1".into(),
            nbd: "10.213.47.11:10809".parse::<SocketAddr>().unwrap(),
            status: "10.213.47.11:10810".parse().unwrap(),
        };
        let d = Discover {
            psk: Some("/etc/netpager/netpager.psk".into()),
            user: Some("lab".into()),
            export: "prefetchd-busy1@256M".into(),
            insecure: false,
            trust_network: Vec::new(),
            mdns: true,
            domains: Vec::new(),
            dns_server: None,
        };
        let g = discovered_arg(&a, &d);
        assert_eq!(donor_name(&g), "10.213.47.11:10809/prefetchd-busy1@256M");
        assert_eq!(g.status.as_deref(), Some("10.213.47.11:10810"));
        assert_eq!(g.memory.tls_psk_file, d.psk);
        assert_eq!(g.memory.tls_username.as_deref(), Some("lab"));
    }
}
