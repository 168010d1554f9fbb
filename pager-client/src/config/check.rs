//! Checking a configuration field by field; each error names the field.

use std::path::Path;

use netpager_util::HostPort;

use super::{ConfigError, DeviceConfig, Mode, MAX_WIDTH};

impl DeviceConfig {
    /// Checks every field; errors name the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check("")
    }

    pub(super) fn check(&self, where_: &str) -> Result<(), ConfigError> {
        let bad = |field: &str, reason: String| {
            Err(ConfigError::Invalid {
                where_: where_.to_string(),
                field: field.to_string(),
                reason,
            })
        };
        if self.client_id.is_empty() || self.client_id.contains(['@', '/', ' ']) {
            return bad(
                "client_id",
                format!(
                    "{:?} must be non-empty without '@', '/' or spaces",
                    self.client_id
                ),
            );
        }
        for d in &self.discover_domain {
            if let Err(e) = netpager_membership::dns::wire::Name::parse(d) {
                return bad("discover_domain", e.to_string());
            }
        }
        if let Some(s) = &self.dns_server {
            if let Err(e) = netpager_membership::dns::parse_server(s) {
                return bad("dns_server", e);
            }
        }
        if let Some(e) = &self.discover_export {
            // As the export of a donor spec (`HOST:PORT/EXPORT`) takes it.
            if e.is_empty() || e.starts_with('@') || e.contains(['/', ',', ' ']) {
                return bad(
                    "discover_export",
                    format!("{e:?} must be NAME[@SIZE], without '/', ',' or spaces"),
                );
            }
        }
        if let Some(dev) = &self.device_id {
            if dev.is_empty()
                || dev.len() > 64
                || !dev.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            {
                return bad(
                    "device_id",
                    format!("{dev:?} must be 1 to 64 letters, digits or '-'"),
                );
            }
        }
        if let Some(m) = &self.metrics {
            if let Err(e) = netpager_util::HostPort::parse(&m.listen) {
                return bad("metrics.listen", e.to_string());
            }
        }
        let e = self.extent_size.0;
        if e < 4096 || !e.is_power_of_two() || e > (64 << 20) {
            return bad(
                "extent_size",
                format!("{e} must be a power of two between 4096 and 64 MiB"),
            );
        }
        if self.size.0 == 0 || !self.size.0.is_multiple_of(4096) {
            return bad(
                "size",
                format!("{} must be a positive multiple of 4096", self.size.0),
            );
        }
        if self.size.0 / e > u32::MAX as u64 {
            return bad(
                "size",
                format!("{} needs more than 2^32 extents of {e} bytes", self.size.0),
            );
        }
        if self.connections_per_donor == 0 || self.connections_per_donor > 64 {
            return bad(
                "connections_per_donor",
                format!("{} must be 1..=64", self.connections_per_donor),
            );
        }
        if self.io_buffers < 2 {
            return bad(
                "io_buffers",
                format!("{} must be at least 2", self.io_buffers),
            );
        }
        if self.prefetch_pages > crate::readahead::MAX_PREFETCH_PAGES {
            return bad(
                "prefetch_pages",
                format!(
                    "{} must be at most {}",
                    self.prefetch_pages,
                    crate::readahead::MAX_PREFETCH_PAGES
                ),
            );
        }
        let p = &self.policy;
        if !(0.0..=1.0).contains(&p.b) {
            return bad("policy.b", format!("{} must be within [0, 1]", p.b));
        }
        if p.epoch_ms == 0 {
            return bad("policy.epoch_ms", "must be positive".into());
        }
        if p.n_clients == 0 {
            return bad("policy.n_clients", "must be at least 1".into());
        }
        if let Some(s) = p.service_time_us {
            if !(s > 0.0 && s.is_finite()) {
                return bad("policy.service_time_us", format!("{s} must be positive"));
            }
        }
        if self.timeouts.connect_ms == 0 {
            return bad("timeouts.connect_ms", "must be positive".into());
        }
        if self.timeouts.request_ms == 0 {
            return bad("timeouts.request_ms", "must be positive".into());
        }
        // nbdkit changes directory to / when it daemonises: paths must be
        // absolute.
        let relative = |p: &Path| !p.is_absolute();
        if let Some(fb) = &self.fallback {
            if relative(&fb.path) {
                return bad(
                    "fallback.path",
                    format!("{:?} must be an absolute path", fb.path),
                );
            }
            if fb.size.0 == 0 || !fb.size.0.is_multiple_of(e) {
                return bad(
                    "fallback.size",
                    format!(
                        "{} must be a positive multiple of extent_size {e}",
                        fb.size.0
                    ),
                );
            }
        }
        match &self.mode {
            Mode::Parity { width } if *width < 3 || *width > MAX_WIDTH => {
                return bad(
                    "mode.width",
                    format!("{width} must be 3..={MAX_WIDTH} (N-1 data + 1 parity)"),
                );
            }
            Mode::Ec { data, parity } if *data < 1 || *parity < 1 || data + parity > MAX_WIDTH => {
                return bad(
                    "mode.data",
                    format!(
                        "{data}+{parity}: data and parity must each be at least 1, \
                         at most {MAX_WIDTH} in all"
                    ),
                );
            }
            Mode::Disk { path, .. } if relative(path) => {
                return bad(
                    "mode.path",
                    format!("write-through file {path:?} must be an absolute path"),
                );
            }
            Mode::Disk { queue, .. } if queue.0 < 4096 => {
                return bad("mode.queue", format!("{} must be at least 4096", queue.0));
            }
            _ => {}
        }
        if let Some(log) = self.parity_log {
            if !self.mode.striped() {
                return bad("parity_log", "only applies to modes parity and ec".into());
            }
            if !log.0.is_multiple_of(4096) {
                return bad(
                    "parity_log",
                    format!("{} must be a multiple of 4096", log.0),
                );
            }
        }
        for (i, d) in self.donors.iter().enumerate() {
            let f = |name: &str| format!("donors[{i}].{name}");
            if d.name.is_empty() || d.name.len() > 200 {
                return bad(&f("name"), "must be 1..=200 bytes".into());
            }
            if self.donors[..i].iter().any(|o| o.name == d.name) {
                return bad(&f("name"), format!("{:?} is used by two donors", d.name));
            }
            if let Err(e) = HostPort::parse(&d.address) {
                return bad(&f("address"), e.to_string());
            }
            if self.donors[..i]
                .iter()
                .any(|o| o.address == d.address && o.export == d.export)
            {
                return bad(
                    &f("address"),
                    format!("{} is used by two donors", d.address),
                );
            }
            if let Some(s) = &d.status {
                if let Err(e) = HostPort::parse(s) {
                    return bad(&f("status"), e.to_string());
                }
            }
            if let Some(p) = d.tls_psk_file.as_deref().filter(|p| relative(p)) {
                return bad(
                    &f("tls_psk_file"),
                    format!("{p:?} must be an absolute path"),
                );
            }
            if let Some(sz) = d.export_size {
                if sz.0 < 2 * e {
                    return bad(
                        &f("export_size"),
                        format!("{} is smaller than two extents", sz.0),
                    );
                }
            }
        }
        let need = self.mode.donors_needed();
        // With a donors file the set fills at run time: the file's donors
        // join at the first epoch.
        if self.donors.len() < need
            && self.donors_file.is_none()
            && !self.discover
            && self.discover_domain.is_empty()
        {
            let what = match self.mode {
                Mode::Mirror => "mirror needs at least 2 distinct donors".to_string(),
                Mode::Parity { width } => {
                    format!("parity of width {width} needs at least {width} distinct donors")
                }
                Mode::Ec { data, parity } => format!(
                    "ec {data}+{parity} needs at least {} distinct donors",
                    data + parity
                ),
                _ => "at least one donor is needed".to_string(),
            };
            return bad(
                "donors",
                format!(
                    "{what}, {} given (or name a donors_file)",
                    self.donors.len()
                ),
            );
        }
        Ok(())
    }
}
