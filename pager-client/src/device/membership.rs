//! Live membership: the device's donor set changes while it stays attached
//! (DESIGN.md, "Live membership"). Donors join from the configuration at
//! open, by [`Device::add_donor`](super::Device::add_donor) (`pagerctl
//! donor-add`), from the donors file, or by discovery; they leave by
//! [`Device::remove_donor`](super::Device::remove_donor) (their extents are
//! drained first), by a line taken out of the donors file, or by being
//! forgotten after `forget_after` dead. Every change is journaled with the
//! extent map, so a restart finds the same set.
//!
//! Calls: the extent map (donor records), [`DonorTable`](super::donor::DonorTable),
//! `attach`/`drop_label` (donor.rs); called by `Device`, the epoch thread
//! (donors file) and the maintenance thread (removals, forgetting).

use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use netpager_membership::discovery::{admit, Check};
use netpager_membership::{read_donors_file, DonorSpec, Joined};
use netpager_util::LockExt;

use super::donor::{Donor, MAX_DONOR_ENTRIES};
use super::{DeviceError, Inner, Result};
use crate::config::DonorConfig;
use crate::extent_map::{MemberState, Membership, SlotOwner};
use crate::status::LeftDonor;

/// Departures kept for status (`pagerctl donor-remove --wait` looks there).
const LEFT_KEPT: usize = 32;

/// Membership's bookkeeping beside the donor table.
#[derive(Default)]
pub(crate) struct Book {
    /// The donors file as last parsed, and its modification time.
    file: Option<(SystemTime, Vec<DonorSpec>)>,
    /// Why the donors file was not taken, if it was not.
    pub file_error: Option<String>,
    /// Why a change it asks for could not be made yet (retried each epoch).
    pub file_pending: Option<String>,
    /// The latest departures, newest last.
    pub left: Vec<LeftDonor>,
    /// Announced donors not in the set, by node id, and why not.
    pub not_admitted: BTreeMap<String, String>,
    /// Why discovery is not running, if it was asked for and is not.
    pub discovery_error: Option<String>,
}

pub(crate) fn unix_now() -> u64 {
    unix_now_ms() / 1000
}

pub(crate) fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn refuse(reason: String) -> DeviceError {
    DeviceError::Membership(reason)
}

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

impl Inner {
    fn membership(
        &self,
        joined: Joined,
        since_unix: u64,
        state: MemberState,
        c: &DonorConfig,
    ) -> Membership {
        Membership {
            joined,
            since_unix,
            state,
            config: serde_json::to_string(c).expect("a donor configuration encodes"),
        }
    }

    /// Builds donor `c`'s entry in the table (not yet connected).
    fn push_donor(&self, c: DonorConfig, id: u16, joined: (Joined, u64)) -> Result<&Donor> {
        // The TLS key file doubles as the status endpoint's key: donors
        // started with psk= answer only signed requests.
        let key = c
            .tls_psk_file
            .as_deref()
            .map(|f| netpager_proto::LabKey::from_psk_file(f, None))
            .transpose()
            .map_err(|source| DeviceError::StatusKey {
                donor: c.name.clone(),
                source,
            })?;
        let status_client = netpager_proto::StatusClient {
            timeout: Duration::from_millis(self.cfg.timeouts.connect_ms),
            key,
        };
        let ep = self.cfg.endpoint(&c);
        let (timeouts, conns) = (
            self.cfg.nbd_timeouts(),
            self.cfg.connections_per_donor as usize,
        );
        self.donors
            .push(|idx| Donor::new(idx, id, c, joined, ep, timeouts, conns, status_client))
            .ok_or_else(|| {
                refuse(format!(
                    "this serving process has known {MAX_DONOR_ENTRIES} donors since it started, its most: restart it (pagerctl detach and attach) to add more"
                ))
            })
    }

    /// At open: the configuration's donors (joined at attach) and the
    /// donors the journal says joined later, less those it says left.
    pub(crate) fn join_initial_donors(&self) -> Result<()> {
        let before = self.map.donor_entries();
        let now = unix_now();
        for c in &self.cfg.donors {
            let id = self.map.donor_id(&c.name)?;
            let member = before.get(id as usize).and_then(|e| e.member.clone());
            let joined = match &member {
                Some(m) if m.state.left() => {
                    tracing::warn!(
                        "donor {} is in device.toml but left the set ({} at {}): not used; `pagerctl donor-add` brings it back",
                        c.name,
                        m.joined,
                        m.since_unix
                    );
                    continue;
                }
                Some(m) => (m.joined, m.since_unix),
                None => {
                    self.map.set_donor_member(
                        id,
                        self.membership(Joined::Attach, now, MemberState::Member, c),
                    )?;
                    (Joined::Attach, now)
                }
            };
            let d = self.push_donor(c.clone(), id, joined)?;
            if member.is_some_and(|m| m.state == MemberState::Leaving) {
                d.leaving.store(true, Ordering::Release);
            }
        }
        for (id, e) in before.iter().enumerate() {
            let Some(m) = &e.member else { continue };
            if m.state.left() || self.cfg.donors.iter().any(|c| c.name == e.name) {
                continue;
            }
            let id = id as u16;
            if m.joined == Joined::Attach {
                // Re-attached with another donor list: its copies are lost
                // (forget_unconfigured_donors), as before live membership.
                tracing::warn!(
                    "donor {} is no longer in device.toml: its copies are lost",
                    e.name
                );
                let mut gone = m.clone();
                gone.state = MemberState::Gone;
                gone.since_unix = now;
                self.map.set_donor_member(id, gone)?;
                continue;
            }
            let c: DonorConfig = match serde_json::from_str(&m.config) {
                Ok(c) => c,
                Err(err) => {
                    tracing::error!(
                        "donor {}: its journaled configuration does not parse ({err}); not used, its copies are lost",
                        e.name
                    );
                    continue;
                }
            };
            let d = self.push_donor(c, id, (m.joined, m.since_unix))?;
            if m.state == MemberState::Leaving {
                d.leaving.store(true, Ordering::Release);
            }
        }
        Ok(())
    }

    /// The live donor named `key`, or at address `key`.
    fn find_member(&self, key: &str) -> Option<&Donor> {
        self.donors
            .iter()
            .find(|d| d.cfg.name == key)
            .or_else(|| self.donors.iter().find(|d| d.cfg.address == key))
    }

    /// Adds donor `c` to the set: journaled, connected, polled from the
    /// next epoch (run at once). With `reachable`, a donor that cannot be
    /// reached is not added.
    pub(crate) fn add_member(
        &self,
        c: DonorConfig,
        how: Joined,
        reachable: bool,
    ) -> Result<&Donor> {
        if let Some(d) = self.find_member(&c.name) {
            return Err(refuse(format!(
                "donor {} is already a member ({} since {})",
                c.name, d.joined, d.joined_unix
            )));
        }
        if let Some(d) = self.donors.iter().find(|d| d.cfg.address == c.address) {
            return Err(refuse(format!(
                "{} is already a member as donor {}",
                c.address, d.cfg.name
            )));
        }
        netpager_util::HostPort::parse(&c.address)
            .map_err(|e| refuse(format!("donor {}: address {}: {e}", c.name, c.address)))?;
        let id = self.map.donor_id(&c.name)?;
        let now = unix_now();
        let d = self.push_donor(c, id, (how, now))?;
        self.attach(d);
        if d.is_failed() {
            // Why, in words an admin acts on (status shows it too).
            if let Err(p) = crate::probe::check(&self.cfg, &d.cfg) {
                d.health().failure = Some(p.to_string());
            }
        }
        if reachable && d.is_failed() {
            let why = d.health().failure.clone().unwrap_or_default();
            self.donors.retire(d);
            return Err(refuse(format!(
                "donor {} cannot be used: {why}",
                d.cfg.name
            )));
        }
        self.map
            .set_donor_member(id, self.membership(how, now, MemberState::Member, &d.cfg))?;
        tracing::info!(
            "donor {} ({}) joined ({how}){}",
            d.cfg.name,
            d.cfg.address,
            if d.is_failed() {
                "; not reachable yet, retried every epoch"
            } else {
                ""
            }
        );
        self.epoch_wake.notify();
        // Status shows it at once, not at the next maintenance pass.
        self.write_status();
        Ok(d)
    }

    /// Distinct healthy donors a new unit needs.
    fn donors_needed(&self) -> usize {
        self.layout.members()
    }

    /// Starts removing donor `key` (name or address): nothing new goes
    /// there, the maintenance thread moves its extents off, then it leaves
    /// the set. Refused when the mode could not place a unit without it.
    pub(crate) fn remove_member(&self, key: &str) -> Result<&Donor> {
        let d = self.find_member(key).ok_or_else(|| {
            let names: Vec<&str> = self.donors.iter().map(|d| d.cfg.name.as_str()).collect();
            refuse(format!(
                "no donor named or at {key:?} (members: {})",
                names.join(", ")
            ))
        })?;
        if d.is_leaving() {
            return Ok(d);
        }
        let healthy_others = self
            .donors
            .iter()
            .filter(|o| o.idx != d.idx && !o.is_failed() && !o.is_leaving())
            .count();
        let need = self.donors_needed();
        // A dead donor's pages are rebuilt elsewhere anyway: letting it go
        // costs nothing.
        if !d.is_failed() && healthy_others < need {
            return Err(refuse(format!(
                "mode {} keeps each {} on {need} distinct donors; without {} only {healthy_others} healthy donors are left: add one first (pagerctl donor-add)",
                self.cfg.mode.word(),
                if self.layout.mode.striped() { "group" } else { "extent's copies" },
                d.cfg.name
            )));
        }
        self.map.set_donor_member(
            d.id,
            self.membership(d.joined, d.joined_unix, MemberState::Leaving, &d.cfg),
        )?;
        d.leaving.store(true, Ordering::Release);
        tracing::info!(
            "donor {} is leaving: moving its extents to the other donors",
            d.cfg.name
        );
        self.maint_wake.notify();
        self.write_status();
        Ok(d)
    }

    /// Takes donor `d` out of the set for good, journaled, and says so.
    fn let_go(&self, d: &Donor, why: &str) {
        let state = if why == "removed" {
            MemberState::Removed
        } else {
            MemberState::Gone
        };
        let m = self.membership(d.joined, unix_now(), state, &d.cfg);
        if let Err(e) = self.map.set_donor_member(d.id, m) {
            tracing::error!("journaling donor {}'s departure: {e}", d.cfg.name);
            return;
        }
        self.donors.retire(d);
        self.map.forget_donor_slots(d.id);
        let mut book = self.membership.lock_or_recover();
        book.left.push(LeftDonor {
            name: d.cfg.name.clone(),
            address: d.cfg.address.clone(),
            joined: d.joined,
            left_unix: unix_now(),
            why: why.to_string(),
        });
        let excess = book.left.len().saturating_sub(LEFT_KEPT);
        book.left.drain(..excess);
    }

    /// Maintenance: leaving donors that hold nothing any more leave the
    /// set; donors dead longer than `forget_after` are forgotten.
    pub(crate) fn settle_membership(&self) {
        let mut changed = false;
        for d in self.donors.iter() {
            let (held, _) = self.map.slot_usage(SlotOwner::Donor(d.id));
            if held != 0 {
                continue;
            }
            if d.is_leaving() {
                if !d.is_failed() {
                    if let Err(e) = self.drop_label(d) {
                        tracing::warn!("donor {}: {e}", d.cfg.name);
                    }
                }
                tracing::info!(
                    "donor {} removed: nothing of ours is left on it",
                    d.cfg.name
                );
                let why = if d.joined == Joined::File {
                    "file"
                } else {
                    "removed"
                };
                self.let_go(d, why);
                changed = true;
                continue;
            }
            let forget_after = Duration::from_millis(self.cfg.forget_after_ms);
            let dead_for = {
                let h = d.health();
                h.marked
                    .then_some(h.failed_at)
                    .flatten()
                    .map(|t| t.elapsed())
            };
            if self.cfg.forget_after_ms > 0
                && d.is_failed()
                && dead_for.is_some_and(|t| t >= forget_after)
            {
                tracing::warn!(
                    "donor {} forgotten: dead for {}s ({})",
                    d.cfg.name,
                    dead_for.unwrap_or_default().as_secs(),
                    d.health().failure.clone().unwrap_or_default()
                );
                self.let_go(d, "forgotten");
                changed = true;
            }
        }
        if changed {
            self.write_status();
        }
    }

    /// Epoch: applies the donors file (when configured) to the set. A file
    /// that does not parse changes nothing; a change that cannot be made
    /// yet (a removal the mode refuses) is tried again next epoch.
    pub(crate) fn follow_donors_file(&self) {
        let Some(path) = self.cfg.donors_file.clone() else {
            return;
        };
        let Some(wanted) = self.read_donors_file(&path) else {
            return;
        };
        let psk = self.cfg.lab_key();
        let from_file: Vec<DonorSpec> = self
            .donors
            .iter()
            .filter(|d| d.joined == Joined::File && !d.is_leaving())
            .map(|d| spec_of(&d.cfg))
            .collect();
        let changes = netpager_membership::diff(&from_file, &wanted);
        let mut pending = Vec::new();
        for s in &changes.add {
            // Already in the set some other way (attach, added): nothing to do.
            if self.find_member(&s.name).is_some()
                || self.donors.iter().any(|d| d.cfg.address == s.addr)
            {
                continue;
            }
            if let Err(e) = self.add_member(
                DonorConfig::from_spec(s, psk.as_deref()),
                Joined::File,
                false,
            ) {
                pending.push(e.to_string());
            }
        }
        for name in &changes.remove {
            if let Err(e) = self.remove_member(name) {
                pending.push(e.to_string());
            }
        }
        for s in &changes.changed {
            pending.push(format!(
                "donor {} changed its address, export or status endpoint in the file: remove its line, then add it under a new name",
                s.name
            ));
        }
        let pending = (!pending.is_empty()).then(|| pending.join("; "));
        let mut book = self.membership.lock_or_recover();
        if pending.is_some() && pending != book.file_pending {
            tracing::warn!(
                "donors file {}: {}",
                path.display(),
                pending.as_deref().unwrap_or_default()
            );
        }
        book.file_pending = pending;
    }

    /// Epoch: adds donors announced on the lab's network whose status
    /// verifies with the lab key (or, without a key, that may be used
    /// unverified). A donor that stops announcing stays; one the admin
    /// removed is not brought back.
    pub(crate) fn follow_discovery(&self) {
        let Some(browser) = &self.browser else {
            return;
        };
        let key = self.cfg.lab_key();
        let lab_key = match key
            .as_deref()
            .map(|f| netpager_proto::LabKey::from_psk_file(f, None))
            .transpose()
        {
            Ok(k) => k,
            Err(e) => {
                self.membership.lock_or_recover().discovery_error =
                    Some(format!("lab key: {e}; no discovered donor is used"));
                return;
            }
        };
        // TLS to a discovered donor as the lab key's (first) user, the one
        // its status is signed for.
        let user = lab_key.as_ref().map(|k| k.username().to_string());
        let client = lab_key.map(|k| netpager_proto::StatusClient {
            timeout: Duration::from_millis(self.cfg.timeouts.connect_ms),
            key: Some(k),
        });
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
        for a in browser.announced() {
            if self.find_member(&a.node_id).is_some()
                || self
                    .donors
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
            let status = client.as_ref().map(|c| c.query(&a.status.to_string()));
            let failed = match &status {
                Some(Err(e)) => e.to_string(),
                _ => String::new(),
            };
            let check = match &status {
                None => Check::NoKey,
                Some(Ok(s)) => Check::Signed(Ok(&s.node_id)),
                Some(Err(_)) => Check::Signed(Err(&failed)),
            };
            let why = match admit(&a, check, self.cfg.discover_insecure) {
                Ok(why) => why,
                Err(not) => {
                    verdicts.insert(a.node_id.clone(), not);
                    continue;
                }
            };
            let mut c = DonorConfig::from_spec(&a.spec(), key.as_deref());
            c.tls_username.clone_from(&user);
            match self.add_member(c, Joined::Discovered, false) {
                Ok(d) => tracing::info!(
                    "discovered donor {} at {} ({why})",
                    d.cfg.name,
                    d.cfg.address
                ),
                Err(e) => {
                    verdicts.insert(a.node_id.clone(), e.to_string());
                }
            }
        }
        let mut book = self.membership.lock_or_recover();
        for (node, why) in &verdicts {
            if book.not_admitted.get(node) != Some(why) {
                tracing::warn!("announced donor {node} not used: {why}");
            }
        }
        book.not_admitted = verdicts;
    }

    /// The donors file's specs: parsed again when it changed, else as last
    /// parsed; `None` while it has never parsed.
    fn read_donors_file(&self, path: &PathBuf) -> Option<Vec<DonorSpec>> {
        let mtime = std::fs::metadata(path).and_then(|m| m.modified());
        let mut book = self.membership.lock_or_recover();
        if let (Ok(t), Some((seen, specs))) = (&mtime, &book.file) {
            if t == seen {
                return Some(specs.clone());
            }
        }
        match read_donors_file(path) {
            Ok(specs) => {
                if book.file_error.take().is_some() {
                    tracing::info!("donors file {} parses again", path.display());
                }
                let t = mtime.unwrap_or(UNIX_EPOCH);
                book.file = Some((t, specs.clone()));
                Some(specs)
            }
            Err(e) => {
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
