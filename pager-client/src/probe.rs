//! Whether a device can use a donor, and if not, why, in words an admin
//! acts on: nothing listens there, it is the status port and not NBD, the
//! TLS key is not the donor's, the client id has no line in the PSK file,
//! the export is refused, the donor is draining or full.
//!
//! `pagerctl attach` checks every donor with [`check`] before it creates a
//! device (the options' donors, the donors file's lines, and the members
//! the map's journal says joined later: [`starting_donors`]), and the
//! running device asks [`check`] why a donor it was given (donor-add, a
//! donors file line) could not be attached. Each check is the first thing
//! that fails in the order a connection meets them: the lab key file on
//! this side, TCP, the NBD greeting, NBD negotiation (TLS, the export), the
//! status endpoint, the donor's room.

use std::io::Read;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

use netpager_proto::auth::AuthError;
use netpager_proto::{DonorState, DonorStatus, LabKey, ProtoError, StatusClient};
use netpager_util::format_size;

use crate::config::{DeviceConfig, DonorConfig};
use crate::extent_map::{ExtentMap, Layout};

/// Why a donor cannot take a device's pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// It cannot be talked to as configured.
    Unreachable(String),
    /// It answers, but takes no new page now (draining, full).
    NoRoom(String),
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Problem::Unreachable(why) | Problem::NoRoom(why) => f.write_str(why),
        }
    }
}

/// The session a probe connects in: older than any a device begins (they
/// count from 1), so a probe never fences a device's serving process.
const PROBE_SESSION: u64 = 0;

/// Checks donor `d` of device `cfg` as the device would use it; its
/// status when it has a status endpoint.
pub fn check(cfg: &DeviceConfig, d: &DonorConfig) -> Result<Option<DonorStatus>, Problem> {
    let timeout = Duration::from_millis(cfg.timeouts.connect_ms);
    let ep = cfg.endpoint(d, PROBE_SESSION);
    let status_client = match &d.tls_psk_file {
        Some(file) => {
            let user = ep.tls_username.as_deref().unwrap_or(&cfg.client_id);
            Some(lab_key(file, user).map_err(Problem::Unreachable)?)
        }
        None => None,
    }
    .map_or(StatusClient { timeout, key: None }, |key| StatusClient {
        timeout,
        key: Some(key),
    });
    greeting(&d.address, timeout, &status_client).map_err(Problem::Unreachable)?;
    if let Err(e) = netpager_nbd::Connection::connect(&ep, timeout) {
        return Err(Problem::Unreachable(nbd_refusal(
            &e.to_string(),
            cfg,
            d,
            &status_client,
        )));
    }
    let Some(addr) = &d.status else {
        return Ok(None);
    };
    let status = status_client
        .query(addr)
        .map_err(|e| Problem::Unreachable(status_failure(addr, &e)))?;
    room(cfg, d, &status)?;
    Ok(Some(status))
}

/// The lab key of `file` for TLS identity `user`, or why this side's file
/// cannot work: TLS presents the client id, so the file needs a line for
/// it, with the same key as its first line (which signs status requests).
fn lab_key(file: &Path, user: &str) -> Result<LabKey, String> {
    let first = LabKey::from_psk_file(file, None).map_err(|e| format!("the lab key: {e}"))?;
    let mine = match LabKey::from_psk_file(file, Some(user)) {
        Ok(k) => k,
        Err(AuthError::NoSuchUser { .. }) => {
            return Err(format!(
                "the lab key file {} has no line for this client's TLS identity {user:?} (TLS presents the client id): add one with the lab key (pagerctl psk add {} {user}), on the donors too",
                file.display(),
                file.display()
            ))
        }
        Err(e) => return Err(format!("the lab key: {e}")),
    };
    if !mine.same_key(&first) {
        return Err(format!(
            "the lab key file {} gives identity {user:?} another key than its first line ({}): every line must hold the one lab key",
            file.display(),
            first.username()
        ));
    }
    Ok(first)
}

/// Connects to the NBD address and waits for an NBD server's greeting.
fn greeting(addr: &str, timeout: Duration, status: &StatusClient) -> Result<(), String> {
    let sa = addr
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| format!("cannot resolve {addr}"))?;
    let mut s = TcpStream::connect_timeout(&sa, timeout).map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused => format!(
            "nothing listens at {addr}: is the donor's nbdkit running, and is {} its NBD port (nbdkit --port)?",
            sa.port()
        ),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => format!(
            "{addr} did not answer within {} s: is the host up, and does a firewall let the port through?",
            timeout.as_secs_f64().ceil()
        ),
        _ => format!("cannot connect to {addr}: {e}"),
    })?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| format!("{addr}: {e}"))?;
    let mut got = [0u8; 16];
    let mut n = 0;
    while n < got.len() {
        match s.read(&mut got[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    drop(s);
    if &got[..n] == b"NBDMAGICIHAVEOPT" {
        return Ok(());
    }
    if n > 0 {
        return Err(format!(
            "{addr} is not an NBD server (it greets with {:?})",
            String::from_utf8_lossy(&got[..n])
        ));
    }
    // Silent: a status endpoint waits for a request.
    match status.query(addr) {
        Ok(_) | Err(ProtoError::Refused { .. }) => Err(format!(
            "{addr} is a status endpoint, not NBD: the donor's NBD port is nbdkit's --port and its status port pager-server's status= (swapped?)"
        )),
        Err(_) => Err(format!(
            "{addr} accepted the connection but sent no NBD greeting within {} s: it is not an NBD server, or the donor is hung",
            timeout.as_secs_f64().ceil()
        )),
    }
}

/// Why NBD negotiation with donor `d` failed (`message`, from the NBD
/// client), in words; the status endpoint tells the cases TLS and NBD
/// cannot tell apart.
fn nbd_refusal(
    message: &str,
    cfg: &DeviceConfig,
    d: &DonorConfig,
    status: &StatusClient,
) -> String {
    let m = message.to_ascii_lowercase();
    let ep = cfg.endpoint(d, PROBE_SESSION);
    let addr = &d.address;
    if m.contains("tls required") || m.contains("requires tls") {
        return format!(
            "{addr} requires TLS: give the lab key (attach --psk FILE, the file the donor's nbdkit --tls-psk= reads)"
        );
    }
    if m.contains("refused tls") || m.contains("does not support tls") {
        return format!(
            "{addr} does not offer TLS (its nbdkit runs without --tls): attach without --psk, or start the donor with --tls=require --tls-psk=FILE"
        );
    }
    if m.contains("gnutls") || m.contains("tls") {
        let user = ep.tls_username.clone().unwrap_or_default();
        let key_file = d
            .tls_psk_file
            .as_deref()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        // A donor's TLS refuses a wrong key and an unknown identity alike;
        // its signed status tells whether it holds the key at all.
        let key_known = d
            .status
            .as_deref()
            .is_some_and(|a| status.key.is_some() && status.query(a).is_ok());
        return if key_known {
            format!(
                "TLS handshake with {addr} failed: the donor holds this lab key but its PSK file has no line for this client's identity {user:?}: add `{user}:KEY` (the lab key) to the file its nbdkit --tls-psk= reads (pagerctl psk add FILE {user})"
            )
        } else {
            format!(
                "TLS handshake with {addr} failed: the donor does not hold this lab key ({key_file}) for identity {user:?}: its nbdkit --tls-psk= file must have the line `{user}:KEY` with the same key"
            )
        };
    }
    if m.contains("unknown export") || m.contains("no export named") || m.contains("forbidden") {
        return export_refusal(cfg, d, status, &ep.export);
    }
    if m.contains("timed out") {
        return format!(
            "{addr} did not finish NBD negotiation within {} s (a hung or overloaded donor?)",
            cfg.timeouts.connect_ms.div_ceil(1000)
        );
    }
    message.to_string()
}

/// The export's store name on the donor: the name without its token,
/// size and generation (`CLIENT~TOKEN/DEVICE:GEN@SIZE` -> `CLIENT/DEVICE`).
fn store_name(export: &str) -> String {
    let name = export.split('@').next().unwrap_or(export);
    let (client, device) = match name.split_once('/') {
        Some((c, d)) => (c, Some(d.split(':').next().unwrap_or(d))),
        None => (name, None),
    };
    let client = client.split('~').next().unwrap_or(client);
    match device {
        Some(d) => format!("{client}/{d}"),
        None => client.to_string(),
    }
}

/// Why the donor would not open our export. NBD says "unknown export"
/// whatever the plugin's reason; the donor's status shows a size conflict.
fn export_refusal(
    cfg: &DeviceConfig,
    d: &DonorConfig,
    status: &StatusClient,
    export: &str,
) -> String {
    let addr = &d.address;
    let store = store_name(export);
    let size = cfg.export_size(d);
    let held = d
        .status
        .as_deref()
        .and_then(|a| status.query(a).ok())
        .and_then(|s| s.exports.into_iter().find(|e| e.name == store));
    match held {
        Some(e) if e.size_bytes != size => format!(
            "{addr} holds export {store} of {} already ({} used, {} clients connected) and this device asks for {}: another device of client {:?} uses that name; give this device its own --client-id, or free the other's pages (pagerctl release --state-dir ITS_DIR)",
            format_size(e.size_bytes),
            format_size(e.used_bytes),
            e.clients,
            format_size(size),
            cfg.client_id
        ),
        _ => format!(
            "{addr} refused to open export {export:?}: a wrong or missing export token (a donor with export-secret= opens CLIENT~TOKEN names only, from netpager-token), plain text from another machine (the donor wants TLS: --psk), or another reason its log gives"
        ),
    }
}

/// A status query's failure, with what to do about a key mismatch.
pub fn status_failure(addr: &str, e: &ProtoError) -> String {
    let text = e.to_string();
    if text.contains("authentication required") {
        format!("status endpoint {addr} requires signed requests: give the lab key (--psk FILE)")
    } else if text.contains("bad MAC") {
        format!("status endpoint {addr} refused our signature: the donor does not hold this lab key (its psk= file's first line)")
    } else {
        text
    }
}

/// Whether donor `d`, by its status, can take one more unit now.
fn room(cfg: &DeviceConfig, d: &DonorConfig, s: &DonorStatus) -> Result<(), Problem> {
    if s.state() == DonorState::Draining {
        let why = if s.state_reason.is_empty() {
            String::new()
        } else {
            format!(" ({})", s.state_reason)
        };
        return Err(Problem::NoRoom(format!(
            "{} is draining{why}: it takes no new pages (pagerctl donor-drain {} --undo ends a drain an admin asked for)",
            d.address,
            d.status.as_deref().unwrap_or("STATUS_ADDR")
        )));
    }
    if s.free_bytes < cfg.extent_size.0 {
        return Err(Problem::NoRoom(format!(
            "{} is full: {} of its budget of {} used, no room for one extent of {} (raise its budget=, or add a donor)",
            d.address,
            format_size(s.used_bytes),
            format_size(s.budget_bytes),
            format_size(cfg.extent_size.0)
        )));
    }
    Ok(())
}

/// The donors a device starts with: the configuration's, the members the
/// map's journal (in `state_dir`, for a device that exists) says joined
/// later, and the lines of its donors file; each once, by name, less those
/// the journal says left.
pub fn starting_donors(
    cfg: &DeviceConfig,
    state_dir: Option<&Path>,
) -> Result<Vec<DonorConfig>, String> {
    let mut out: Vec<DonorConfig> = cfg.donors.clone();
    if let Some(dir) = state_dir {
        let map = ExtentMap::open(dir, Layout::from_config(cfg))
            .map_err(|e| format!("reading the extent map in {}: {e}", dir.display()))?;
        for e in map.donor_entries() {
            let Some(m) = e.member else { continue };
            if m.state.left() {
                out.retain(|d| d.name != e.name);
            } else if !out.iter().any(|d| d.name == e.name) {
                if let Ok(c) = serde_json::from_str::<DonorConfig>(&m.config) {
                    out.push(c);
                }
            }
        }
    }
    if let Some(file) = &cfg.donors_file {
        let psk = cfg.lab_key();
        for s in netpager_membership::read_donors_file(file).map_err(|e| e.to_string())? {
            if !out.iter().any(|d| d.name == s.name || d.address == s.addr) {
                out.push(DonorConfig::from_spec(&s, psk.as_deref()));
            }
        }
    }
    Ok(out)
}

/// Donors usable at once that device `cfg` needs to place a unit: its
/// mode's members, or none with a fallback file (which takes what donors
/// cannot).
pub fn donors_needed(cfg: &DeviceConfig) -> usize {
    if cfg.fallback.is_some() {
        0
    } else {
        cfg.mode.donors_needed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_names_drop_token_size_and_generation() {
        assert_eq!(store_name("alice@4G"), "alice");
        assert_eq!(store_name("alice~0011@4G"), "alice");
        assert_eq!(store_name("alice~0011/swap:3@4G"), "alice/swap");
        assert_eq!(store_name("alice/swap"), "alice/swap");
    }
}
