//! The donor set follows the lab: the donors file an admin or Ansible
//! keeps (re-read each epoch), and donors announced on the lab's network.
//! Both join and leave through [`Membership`](super::membership::Membership)'s
//! changes, like `pagerctl donor-add` and `donor-remove`.
//!
//! Calls: `Inner::add_member`/`remove_member` (membership.rs), the
//! donors file and discovery of `netpager-membership`; runs on the epoch
//! thread, but for announced donors' checks, which run on discovery's
//! admission thread.

use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use netpager_membership::discovery::{self, Admission, Announced, Trust, Verdict};
use netpager_membership::{
    parse_donors_file_lines, read_donors_file_lines, settled_text, DonorSpec, Joined,
};

use super::Inner;
use crate::config::{DeviceConfig, DonorConfig};
use crate::extent_map::MemberState;

/// Whether the configured address `addr` (`HOST:PORT`) is `at`.
fn same_endpoint(addr: &str, at: SocketAddr) -> bool {
    addr.to_socket_addrs().is_ok_and(|mut a| a.any(|x| x == at))
}

/// A donor's configuration as a spec, to compare with the donors file.
fn spec_of(c: &DonorConfig) -> DonorSpec {
    DonorSpec {
        addr: c.address.clone(),
        export: c.export.clone(),
        status: c.status.clone(),
        name: c.name.clone(),
    }
}

/// Starts browsing (`discover`, `discover_domain`) and checking announced
/// donors on a thread of its own, every `period`, as `admit` says: the lab
/// key's signed status, or a trusted network. The device's epochs read its
/// verdicts; `pagerctl attach` counts the donors it admits before the
/// device exists (`--wait-donors`).
pub fn start_admission(cfg: &DeviceConfig, period: Duration) -> Result<Admission, String> {
    let timeout = Duration::from_millis(cfg.timeouts.connect_ms);
    let server = cfg
        .dns_server
        .as_deref()
        .map(netpager_membership::dns::parse_server)
        .transpose()?;
    let mut sources =
        discovery::Sources::start(cfg.discover, &cfg.discover_domain, server, timeout)?;
    let key = cfg.lab_key();
    let trust = Trust {
        networks: cfg.trust_network.clone(),
        insecure: cfg.discover_insecure,
    };
    let check = move |a: &Announced| -> Verdict {
        let key = key
            .as_deref()
            .map(|f| netpager_proto::LabKey::from_psk_file(f, None))
            .transpose()
            .map_err(|e| format!("lab key: {e}"))?;
        discovery::check(&netpager_proto::StatusClient { timeout, key }, a, &trust)
    };
    Admission::start(move || sources.round(), check, period)
        .map_err(|e| format!("discovery: cannot start its thread: {e}"))
}

/// The lab key's (first) user: TLS to a discovered donor as the one its
/// status is signed for.
fn lab_key_user(cfg: &DeviceConfig) -> Option<String> {
    cfg.lab_key().as_deref().and_then(|f| {
        netpager_proto::LabKey::from_psk_file(f, None)
            .ok()
            .map(|k| k.username().to_string())
    })
}

/// The configuration an admitted announced donor joins device `cfg` with:
/// its announced address and status endpoint, the lab key, TLS as the
/// key's user, the export `discover_export` names.
pub fn discovered_config(cfg: &DeviceConfig, a: &Announced) -> DonorConfig {
    let key = cfg.lab_key();
    let mut c = DonorConfig::from_spec(&a.spec(), key.as_deref());
    c.tls_username = lab_key_user(cfg);
    c.export.clone_from(&cfg.discover_export);
    c
}

impl Inner {
    /// At open: when the configured donors cannot place a unit and
    /// discovery may bring more (a client with no donors file), waits for
    /// discovery's first round, bounded, so that the open's epoch adds the
    /// donors it admitted: the device serves with them from its first
    /// request, and attach's swap step finds them in status.json.
    pub(crate) fn await_discovery_at_open(&self) {
        let Some(admission) = &self.admission else {
            return;
        };
        let needed = crate::probe::donors_needed(&self.cfg);
        let usable = self
            .members
            .iter()
            .filter(|d| !d.is_failed() && !d.is_retired() && !d.is_leaving())
            .count();
        if usable >= needed {
            return;
        }
        // A round: the domain's queries and the checks, each bounded by
        // the connect timeout; far above a healthy lab's round.
        let bound = Duration::from_millis(self.cfg.timeouts.connect_ms)
            .saturating_mul(4)
            .max(Duration::from_secs(5));
        if admission.wait_round(0, bound) == 0 {
            tracing::warn!(
                "discovery: no round finished within {bound:?} of the open; discovered donors join at a later epoch"
            );
        }
    }

    /// Epoch: applies the donors file (when configured) to the set. A file
    /// that does not parse changes nothing; a change that cannot be made
    /// yet (a removal the mode refuses) is tried again next epoch.
    pub(crate) fn follow_donors_file(&self) {
        let Some(path) = self.cfg.donors_file.clone() else {
            return;
        };
        let Some(lines) = self.read_donors_file(&path) else {
            return;
        };
        let wanted: Vec<DonorSpec> = lines.iter().map(|(_, s)| s.clone()).collect();
        let line_of = |name: &str| {
            lines
                .iter()
                .find(|(_, s)| s.name == name)
                .map_or(0, |(l, _)| *l)
        };
        let psk = self.cfg.lab_key();
        let from_file: Vec<DonorSpec> = self
            .members
            .iter()
            .filter(|d| d.joined == Joined::File && !d.is_leaving())
            .map(|d| spec_of(&d.cfg))
            .collect();
        let changes = netpager_membership::diff(&from_file, &wanted);
        let mut pending = Vec::new();
        for s in &changes.add {
            // Already in the set some other way (attach, added): nothing to do.
            if self.members.find(&s.name).is_some()
                || self.members.iter().any(|d| d.cfg.address == s.addr)
            {
                continue;
            }
            if let Err(e) = self.add_member(
                DonorConfig::from_spec(s, psk.as_deref()),
                Joined::File,
                false,
            ) {
                pending.push(format!("line {}: {e}", line_of(&s.name)));
            }
        }
        for name in &changes.remove {
            if let Err(e) = self.remove_member(name) {
                pending.push(e.to_string());
            }
        }
        for s in &changes.changed {
            pending.push(format!(
                "line {}: donor {} changed its address, export or status endpoint in the file: remove its line, then add it under a new name",
                line_of(&s.name),
                s.name
            ));
        }
        let pending = (!pending.is_empty()).then(|| pending.join("; "));
        let mut book = self.members.book();
        if pending.is_some() && pending != book.file_pending {
            tracing::warn!(
                "donors file {}: {}",
                path.display(),
                pending.as_deref().unwrap_or_default()
            );
        }
        book.file_pending = pending;
    }

    /// Epoch: adds donors announced on the lab's network that the
    /// admission thread admitted (their status verified with the lab key,
    /// or, without a key, on a trusted network). Nothing here waits on an
    /// announced donor's status: only joining an admitted one connects. A
    /// donor that stops announcing stays; one the admin removed is not
    /// brought back.
    pub(crate) fn follow_discovery(&self) {
        let Some(admission) = &self.admission else {
            return;
        };
        let removed: Vec<String> = self
            .map
            .donor_entries()
            .into_iter()
            .filter(|e| {
                e.member
                    .as_ref()
                    .is_some_and(|m| m.state == MemberState::Removed)
            })
            .map(|e| e.name)
            .collect();
        let mut verdicts = BTreeMap::new();
        for (a, verdict) in admission.verdicts() {
            if self.members.find(&a.node_id).is_some()
                || self
                    .members
                    .iter()
                    .any(|d| same_endpoint(&d.cfg.address, a.nbd))
            {
                continue;
            }
            if removed.contains(&a.node_id) {
                verdicts.insert(
                    a.node_id.clone(),
                    "removed by donor-remove (pagerctl donor-add brings it back)".to_string(),
                );
                continue;
            }
            let why = match verdict {
                Ok(why) => why,
                Err(not) => {
                    verdicts.insert(a.node_id.clone(), not);
                    continue;
                }
            };
            let c = discovered_config(&self.cfg, &a);
            match self.add_member(c, Joined::Discovered, false) {
                Ok(d) => tracing::info!(
                    "discovered donor {} at {} ({why})",
                    d.cfg.name,
                    d.cfg.address
                ),
                Err(e) => {
                    admission.not_added(&a.node_id, e.to_string());
                    verdicts.insert(a.node_id.clone(), e.to_string());
                }
            }
        }
        let errors = admission.source_errors();
        let expired: BTreeMap<String, String> = admission
            .expired()
            .into_iter()
            .map(|e| (e.a.node_id, e.why))
            .collect();
        let mut book = self.members.book();
        for (node, why) in &expired {
            if !book.expired.contains_key(node) {
                tracing::warn!("announced donor {node} not used: {why}");
            }
        }
        book.expired = expired;
        for (node, why) in &verdicts {
            if book.not_admitted.get(node) != Some(why) {
                tracing::warn!("announced donor {node} not used: {why}");
            }
        }
        book.not_admitted = verdicts;
        book.discovery_error = (!errors.is_empty()).then(|| errors.join("; "));
    }

    /// The donors file's specs with their lines: parsed again when its
    /// text changed, else as last parsed; `None` while it has never parsed.
    /// By its text, not its modification time: two writes within one tick
    /// of the kernel's clock leave the same time, and the second change
    /// was missed (a bad line written right after a good change went
    /// unreported: the nemesis's "add s1; file-bad").
    ///
    /// A changed text is taken only when the next epoch reads it again
    /// ([`settled_text`]; seen under load: a test's write in place read
    /// empty, and the last donor's removal asked for).
    fn read_donors_file(&self, path: &PathBuf) -> Option<Vec<(usize, DonorSpec)>> {
        let text = std::fs::read_to_string(path);
        let mut book = self.members.book();
        let taken = book.file.as_ref().map(|(t, _)| t.as_str());
        let unsettled = text
            .as_ref()
            .is_ok_and(|t| !settled_text(t, taken, book.file_changing.as_deref()));
        if unsettled {
            book.file_changing = text.ok();
            return book.file.as_ref().map(|(_, s)| s.clone());
        }
        book.file_changing = None;
        let parsed = match (&text, &book.file) {
            // The text last taken (also after a bad line was removed again).
            (Ok(t), Some((seen, specs))) if t == seen => Ok(specs.clone()),
            (Ok(t), _) => parse_donors_file_lines(path, t),
            (Err(_), _) => read_donors_file_lines(path),
        };
        match parsed {
            Ok(specs) => {
                if book.file_error.take().is_some() {
                    tracing::info!("donors file {} parses again", path.display());
                }
                book.file = Some((text.unwrap_or_default(), specs.clone()));
                Some(specs)
            }
            Err(e) => {
                // Read the same again, it is refused again at once.
                book.file_changing = text.ok();
                let msg = format!("{e}; the donor set is left as it was");
                if book.file_error.as_deref() != Some(msg.as_str()) {
                    tracing::error!("donors file: {msg}");
                }
                book.file_error = Some(msg);
                book.file.as_ref().map(|(_, s)| s.clone())
            }
        }
    }
}
