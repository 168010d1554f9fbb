//! Donor specs as `pagerctl attach --donor`, `pagerctl donor-add` and the
//! donors file take them.
//!
//! A donor spec is `HOST:PORT[/EXPORT][,status=HOST:PORT][,name=NAME]`: the
//! donor's NBD address; optionally the export to use on it (default
//! `CLIENT_ID@SIZE`, so each client gets its own export of the right size);
//! optionally the address of its status endpoint (without it the donor counts
//! as idle with unknown capacity, equal weights); optionally the name the
//! extent map and the status use for it (default `HOST:PORT`, or
//! `HOST:PORT/EXPORT` with an export). The name must stay the same across
//! re-attaches: placements are recorded by name.

use netpager_util::HostPort;

/// A donor spec that does not parse, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("donor spec {spec:?}: {reason}")]
pub struct SpecError {
    pub spec: String,
    pub reason: String,
}

/// One `--donor` argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DonorSpec {
    /// `HOST:PORT` of the donor's NBD server.
    pub addr: String,
    /// Export name on the donor, if the spec names one.
    pub export: Option<String>,
    /// `HOST:PORT` of the donor's status endpoint, if given.
    pub status: Option<String>,
    /// Name in the extent map and the status.
    pub name: String,
}

impl std::str::FromStr for DonorSpec {
    type Err = SpecError;

    fn from_str(spec: &str) -> Result<Self, SpecError> {
        let bad = |reason: &str| SpecError {
            spec: spec.to_string(),
            reason: reason.to_string(),
        };
        let mut parts = spec.split(',');
        let head = parts.next().unwrap_or_default();
        let (addr, export) = match head.split_once('/') {
            Some((a, "")) => return Err(bad(&format!("empty export name after {a:?}/"))),
            Some((a, e)) => (a, Some(e.to_string())),
            None => (head, None),
        };
        HostPort::parse(addr).map_err(|r| bad(&format!("NBD address: {r}")))?;
        let mut status = None;
        let mut name = None;
        for opt in parts {
            match opt.split_once('=') {
                Some(("status", v)) => {
                    HostPort::parse(v).map_err(|r| bad(&format!("status address: {r}")))?;
                    if status.replace(v.to_string()).is_some() {
                        return Err(bad("status= given twice"));
                    }
                }
                Some(("name", v)) => {
                    if v.is_empty() || v.len() > 200 {
                        return Err(bad("name= must be 1 to 200 bytes"));
                    }
                    if name.replace(v.to_string()).is_some() {
                        return Err(bad("name= given twice"));
                    }
                }
                _ => {
                    return Err(bad(&format!(
                        "unknown option {opt:?} (expected status=HOST:PORT or name=NAME)"
                    )))
                }
            }
        }
        let name = name.unwrap_or_else(|| head.to_string());
        Ok(DonorSpec {
            addr: addr.to_string(),
            export,
            status,
            name,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> DonorSpec {
        s.parse().unwrap()
    }

    #[test]
    fn donor_spec_forms() {
        assert_eq!(
            spec("127.0.0.2:10809"),
            DonorSpec {
                addr: "127.0.0.2:10809".into(),
                export: None,
                status: None,
                name: "127.0.0.2:10809".into()
            }
        );
        assert_eq!(
            spec("d1.lab:10809/alice@64M,status=d1.lab:7070"),
            DonorSpec {
                addr: "d1.lab:10809".into(),
                export: Some("alice@64M".into()),
                status: Some("d1.lab:7070".into()),
                name: "d1.lab:10809/alice@64M".into(),
            }
        );
        assert_eq!(spec("h:1,name=rack2-d1,status=h:2").name, "rack2-d1");
        assert_eq!(
            spec("[::1]:10809,status=[::1]:7070").status.as_deref(),
            Some("[::1]:7070")
        );
    }

    #[test]
    fn donor_spec_errors_name_the_problem() {
        for (bad, needle) in [
            ("127.0.0.2", "no :PORT"),
            ("127.0.0.2:0", "port"),
            ("127.0.0.2:99999", "port"),
            (":10809", "no host"),
            ("127.0.0.2:10809/", "empty export"),
            ("127.0.0.2:10809,stat=1.2.3.4:5", "unknown option"),
            ("127.0.0.2:10809,status=x", "status address"),
            ("127.0.0.2:1,status=a:1,status=a:2", "twice"),
            ("::1:10809", "brackets"),
            ("h:1,name=", "name="),
            ("h:1,name=a,name=b", "twice"),
        ] {
            let e = bad.parse::<DonorSpec>().unwrap_err().to_string();
            assert!(
                e.contains(needle),
                "{bad:?} gave {e:?}, expected it to mention {needle:?}"
            );
        }
    }
}
