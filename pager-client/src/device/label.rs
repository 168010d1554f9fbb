//! The label in slot 0 of every export the device uses: which device's
//! pages the export holds, and which incarnation of them. It is how the
//! device knows a donor by what it is rather than by how it was reached:
//! two addresses (a host name and its IP) that lead to one export show the
//! same label, so the second is refused as a duplicate instead of
//! silently sharing slots with the first; and an export that holds
//! another device's label is never cleared.
//!
//! Layout: the magic (16 bytes), the label (16, little-endian), the
//! length of the owner's record (2), the owner as JSON, a CRC-32 of all
//! of it. Version 1 labels (magic `NETPAGER-LABEL01`, no owner) were
//! written before devices had ids.

use serde::{Deserialize, Serialize};

/// Bytes at the start of slot 0 that hold the label.
pub(crate) const LABEL_BYTES: usize = 4096;
const MAGIC_V1: &[u8; 16] = b"NETPAGER-LABEL01";
const MAGIC: &[u8; 16] = b"NETPAGER-LABEL02";
/// Where the owner's record starts.
const OWNER_AT: usize = 34;

/// The device whose pages an export holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Owner {
    /// The device id (empty for a device attached before ids existed).
    pub device: String,
    pub client: String,
    pub host: String,
    /// Its state directory on that host.
    pub dir: String,
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "device {} of client {} on host {} (state directory {})",
            if self.device.is_empty() {
                "(no id)"
            } else {
                &self.device
            },
            self.client,
            self.host,
            self.dir
        )
    }
}

/// What slot 0 of an export says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Found {
    /// No label: a fresh export, or one whose label was dropped.
    Nothing,
    /// A label of a device older than device ids: whose, it does not say.
    V1(u128),
    Label {
        value: u128,
        owner: Owner,
    },
}

impl Found {
    pub fn value(&self) -> Option<u128> {
        match self {
            Found::Nothing => None,
            Found::V1(v) | Found::Label { value: v, .. } => Some(*v),
        }
    }
}

/// The label block for `value`, owned by `owner`.
pub(crate) fn encode(value: u128, owner: &Owner) -> Vec<u8> {
    let mut b = vec![0u8; LABEL_BYTES];
    b[..16].copy_from_slice(MAGIC);
    b[16..32].copy_from_slice(&value.to_le_bytes());
    let json = serde_json::to_vec(owner).expect("an owner encodes");
    // Fields longer than the block allows are not ours to write: paths
    // and names are far shorter.
    let n = json.len().min(LABEL_BYTES - OWNER_AT - 4);
    b[32..34].copy_from_slice(&(n as u16).to_le_bytes());
    b[OWNER_AT..OWNER_AT + n].copy_from_slice(&json[..n]);
    let crc = crate::extent_map::crc32(&b[..OWNER_AT + n]);
    b[OWNER_AT + n..OWNER_AT + n + 4].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Reads a label block (at least 512 bytes of it for version 1, the
/// whole block for version 2).
pub(crate) fn decode(b: &[u8]) -> Found {
    if b.len() >= 36 && &b[..16] == MAGIC_V1 {
        if crate::extent_map::crc32(&b[..32]).to_le_bytes() == b[32..36] {
            return Found::V1(u128::from_le_bytes(b[16..32].try_into().expect("16 bytes")));
        }
        return Found::Nothing;
    }
    if b.len() < OWNER_AT + 4 || &b[..16] != MAGIC {
        return Found::Nothing;
    }
    let n = u16::from_le_bytes([b[32], b[33]]) as usize;
    let Some(crc) = b.get(OWNER_AT + n..OWNER_AT + n + 4) else {
        return Found::Nothing;
    };
    if crate::extent_map::crc32(&b[..OWNER_AT + n]).to_le_bytes() != crc {
        return Found::Nothing;
    }
    let value = u128::from_le_bytes(b[16..32].try_into().expect("16 bytes"));
    match serde_json::from_slice(&b[OWNER_AT..OWNER_AT + n]) {
        Ok(owner) if value != 0 => Found::Label { value, owner },
        _ => Found::Nothing,
    }
}

/// Whose an export is, as the device opening it sees it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Whose<'a> {
    /// Nobody's, or a stale label of this device's own: clear it and use it.
    Free,
    /// Another device's (or, version 1, possibly): never cleared.
    Other(String),
    /// The label member `.0` of this device holds now: the same export
    /// reached another way.
    Member(&'a str),
}

impl Owner {
    /// The same device in the same place: its id (or, before ids, its
    /// client), host and state directory. A copied configuration (same
    /// id, another directory) is another device.
    fn same(&self, other: &Owner) -> bool {
        let id = |o: &Owner| {
            if o.device.is_empty() {
                o.client.clone()
            } else {
                o.device.clone()
            }
        };
        id(self) == id(other) && self.host == other.host && self.dir == other.dir
    }
}

/// Classifies `found` for device `me`, given the labels its members hold
/// now (name, label).
pub(crate) fn whose<'a>(
    found: &Found,
    me: &Owner,
    members: impl IntoIterator<Item = (&'a str, u128)>,
) -> Whose<'a> {
    let value = match found {
        Found::Nothing => return Whose::Free,
        // A device with an id never wrote one: someone else's.
        Found::V1(_) if !me.device.is_empty() => {
            return Whose::Other("a device of an older netpager (its label names no owner)".into())
        }
        Found::Label { owner, .. } if !owner.same(me) => return Whose::Other(owner.to_string()),
        f => f.value().expect("a label"),
    };
    for (name, v) in members {
        if v == value {
            return Whose::Member(name);
        }
    }
    Whose::Free
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(device: &str) -> Owner {
        Owner {
            device: device.into(),
            client: "busy1".into(),
            host: "h1".into(),
            dir: "/var/lib/netpager/client".into(),
        }
    }

    #[test]
    fn labels_round_trip_and_reject_garbage() {
        let o = owner("00ff");
        let b = encode(7, &o);
        assert_eq!(
            decode(&b),
            Found::Label {
                value: 7,
                owner: o.clone()
            }
        );
        assert_eq!(decode(&vec![0u8; LABEL_BYTES]), Found::Nothing);
        for at in [3, 20, 33, 40] {
            let mut bad = b.clone();
            bad[at] ^= 1;
            assert_eq!(decode(&bad), Found::Nothing, "byte {at} flipped");
        }
        // A version 1 label, as devices without ids wrote them.
        let mut v1 = vec![0u8; 512];
        v1[..16].copy_from_slice(MAGIC_V1);
        v1[16..32].copy_from_slice(&9u128.to_le_bytes());
        let crc = crate::extent_map::crc32(&v1[..32]);
        v1[32..36].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode(&v1), Found::V1(9));
    }

    #[test]
    fn an_export_is_free_ours_a_members_or_another_devices() {
        let (aa, bb, old) = (owner("aa"), owner("bb"), owner(""));
        let mine = Found::Label {
            value: 5,
            owner: aa.clone(),
        };
        let members = [("a", 4u128), ("b", 5u128)];
        assert_eq!(whose(&Found::Nothing, &aa, members), Whose::Free);
        assert_eq!(whose(&mine, &aa, members), Whose::Member("b"));
        assert_eq!(whose(&mine, &aa, [("a", 4u128)]), Whose::Free);
        match whose(&mine, &bb, members) {
            Whose::Other(o) => assert!(o.contains("device aa of client busy1 on host h1"), "{o}"),
            w => panic!("{w:?}"),
        }
        // The same id in another state directory: a copied configuration.
        let copy = Owner {
            dir: "/srv/copy".into(),
            ..aa.clone()
        };
        assert!(matches!(whose(&mine, &copy, members), Whose::Other(_)));
        assert!(matches!(
            whose(&Found::V1(5), &aa, members),
            Whose::Other(_)
        ));
        // A device without an id reads version 1 labels as it always did.
        assert_eq!(whose(&Found::V1(5), &old, members), Whose::Member("b"));
        assert_eq!(whose(&Found::V1(6), &old, members), Whose::Free);
        let legacy = Found::Label {
            value: 6,
            owner: old.clone(),
        };
        assert_eq!(whose(&legacy, &old, members), Whose::Free);
        assert!(matches!(whose(&legacy, &aa, members), Whose::Other(_)));
        // Two devices without ids of two clients on one donor export.
        let other_client = Owner {
            client: "busy2".into(),
            ..old.clone()
        };
        assert!(matches!(
            whose(&legacy, &other_client, members),
            Whose::Other(_)
        ));
    }
}
