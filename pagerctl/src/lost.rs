//! Lost extents as `pagerctl` shows them: the warning `attach` prints when
//! the device comes back with lost data, and the extent ranges
//! `forget-lost --extents` takes.

use std::path::Path;

use netpager_util::format_size;
use pager_client::status::{format_ranges, ClientStatus};

/// Parses `A..B` (inclusive, as status prints ranges) or a single extent.
pub fn parse_extents(s: &str) -> Result<(u64, u64), String> {
    let num = |t: &str| {
        t.trim()
            .parse::<u64>()
            .map_err(|_| format!("{s:?}: {t:?} is not an extent number (expected A..B or A)"))
    };
    let (a, b) = match s.split_once("..") {
        Some((a, b)) => (num(a)?, num(b)?),
        None => {
            let a = num(s)?;
            (a, a)
        }
    };
    if a > b {
        return Err(format!("{s:?}: the range runs backwards ({a} > {b})"));
    }
    Ok((a, b))
}

/// What `attach` says on stderr when the device it attached holds lost
/// data (its donors restarted or died with no copy left), or `None`.
pub fn attach_warning(s: &ClientStatus, device: &Path, state_dir: &Path) -> Option<String> {
    let t = &s.totals;
    if t.lost == 0 && t.unfound_pages == 0 {
        return None;
    }
    let mut lines = Vec::new();
    if t.lost > 0 {
        let more = if t.lost as usize > t.lost_extents.len() {
            ", ..."
        } else {
            ""
        };
        lines.push(format!(
            "WARNING: {} of {}'s extents ({} each) are LOST: {}{more}. Every copy of their data is gone (their donors restarted or died).",
            t.lost,
            device.display(),
            format_size(s.extent_bytes),
            format_ranges(&t.lost_extents),
        ));
        lines.push(
            "  Reads there fail with I/O errors. A write into a lost extent places it again: the pages written read back, the others keep failing until written."
                .to_string(),
        );
    }
    if t.unfound_pages > 0 {
        lines.push(format!(
            "WARNING: {} pages in extents {} were lost and not written since; they read as I/O errors until written.",
            t.unfound_pages,
            format_ranges(&t.unfound_extents),
        ));
    }
    lines.push(format!(
        "  To give the lost data up (it then reads as zeros): pagerctl forget-lost --state-dir {} [--extents A..B]",
        state_dir.display()
    ));
    Some(lines.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pager_client::status::Totals;

    #[test]
    fn extent_ranges_parse_inclusive_or_alone() {
        assert_eq!(parse_extents("0..15"), Ok((0, 15)));
        assert_eq!(parse_extents("7"), Ok((7, 7)));
        assert_eq!(parse_extents(" 3 .. 4 "), Ok((3, 4)));
        assert!(parse_extents("5..2").unwrap_err().contains("backwards"));
        assert!(parse_extents("a..2")
            .unwrap_err()
            .contains("not an extent number"));
        assert!(parse_extents("").is_err());
    }

    #[test]
    fn the_warning_names_the_ranges_and_what_to_do() {
        let mut s = ClientStatus {
            extent_bytes: 1 << 20,
            ..Default::default()
        };
        let (dev, dir) = (Path::new("/dev/loop7"), Path::new("/var/lib/np"));
        assert_eq!(attach_warning(&s, dev, dir), None);
        s.totals = Totals {
            lost: 16,
            lost_extents: (0..16).collect(),
            ..Default::default()
        };
        let w = attach_warning(&s, dev, dir).unwrap();
        assert!(
            w.contains("16 of /dev/loop7's extents (1 MiB each) are LOST: 0..15."),
            "{w}"
        );
        assert!(
            w.contains("pagerctl forget-lost --state-dir /var/lib/np"),
            "{w}"
        );
        assert!(!w.contains("not written since"), "{w}");
        s.totals.unfound_pages = 3;
        s.totals.unfound_extents = vec![20];
        let w = attach_warning(&s, dev, dir).unwrap();
        assert!(w.contains("3 pages in extents 20 were lost"), "{w}");
    }
}
