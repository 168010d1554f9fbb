//! Donor membership: which donors a device uses, and how each came to.
//!
//! A device's donor set changes while it stays attached (DESIGN.md, "Live
//! membership"): donors join at attach, by `pagerctl donor-add`, from a
//! donors file an admin or Ansible keeps, or by discovery on the lab's
//! network, and leave by `pagerctl donor-remove`, by a line taken out of the
//! donors file, or by being forgotten after they died. This crate holds the
//! pure parts every daemon shares: donor specs ([`spec`]), the donors file
//! ([`file`]) and the difference between two sets. The client library
//! (`pager-client`) applies the changes to a running device; prefetchd
//! follows the same file.

pub mod discovery;
pub mod dns;
pub mod file;
pub mod spec;

pub use file::{
    parse_donors_file, parse_donors_file_lines, parse_lines, read_donors_file,
    read_donors_file_lines, settled_text, DonorsFileError,
};
pub use spec::{DonorSpec, SpecError};

/// How a donor joined a device's set (shown by status and `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Joined {
    /// Named by `pagerctl attach --donor` (the device's configuration).
    #[default]
    Attach,
    /// Added by `pagerctl donor-add` while attached.
    Added,
    /// A line of the donors file.
    File,
    /// Announced on the lab's network and verified with the lab key.
    Discovered,
}

impl Joined {
    pub fn as_str(self) -> &'static str {
        match self {
            Joined::Attach => "attach",
            Joined::Added => "added",
            Joined::File => "file",
            Joined::Discovered => "discovered",
        }
    }

    /// The journal's byte for it.
    pub fn code(self) -> u8 {
        match self {
            Joined::Attach => 0,
            Joined::Added => 1,
            Joined::File => 2,
            Joined::Discovered => 3,
        }
    }

    pub fn from_code(c: u8) -> Option<Joined> {
        Some(match c {
            0 => Joined::Attach,
            1 => Joined::Added,
            2 => Joined::File,
            3 => Joined::Discovered,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Joined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What turns one donor set into another, by donor name (the identity the
/// extent map records placements under).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// In the new set only.
    pub add: Vec<DonorSpec>,
    /// In the old set only (names).
    pub remove: Vec<String>,
    /// The same name with another address, export or status endpoint: not
    /// applied, since the map's placements under that name are on the old
    /// address (remove it, then add it under a new name).
    pub changed: Vec<DonorSpec>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.add.is_empty() && self.remove.is_empty() && self.changed.is_empty()
    }
}

/// The changes from donor set `old` to `new`.
pub fn diff(old: &[DonorSpec], new: &[DonorSpec]) -> Changes {
    let mut c = Changes::default();
    for n in new {
        match old.iter().find(|o| o.name == n.name) {
            None => c.add.push(n.clone()),
            Some(o) if o != n => c.changed.push(n.clone()),
            Some(_) => {}
        }
    }
    for o in old {
        if !new.iter().any(|n| n.name == o.name) {
            c.remove.push(o.name.clone());
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(s: &[&str]) -> Vec<DonorSpec> {
        s.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn diff_adds_removes_and_flags_changed_addresses() {
        let old = specs(&["127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1,name=d4"]);
        let new = specs(&["127.0.0.3:1", "127.0.0.5:1", "127.0.0.9:1,name=d4"]);
        let c = diff(&old, &new);
        assert_eq!(c.add, specs(&["127.0.0.5:1"]));
        assert_eq!(c.remove, vec!["127.0.0.2:1".to_string()]);
        assert_eq!(c.changed, specs(&["127.0.0.9:1,name=d4"]));
        assert!(diff(&new, &new).is_empty());
    }

    #[test]
    fn joined_codes_round_trip() {
        for j in [
            Joined::Attach,
            Joined::Added,
            Joined::File,
            Joined::Discovered,
        ] {
            assert_eq!(Joined::from_code(j.code()), Some(j));
        }
        assert_eq!(Joined::from_code(9), None);
    }
}
