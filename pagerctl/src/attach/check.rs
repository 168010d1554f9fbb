//! What `pagerctl attach` concludes from checking its donors before it
//! creates the device (`pager_client::probe` checks each one): whether the
//! mode can place a unit, and if not, every donor's reason in words. The
//! donors are the ones given (options, donors file) and, with discovery,
//! the ones it found and admitted as the device's epochs would ([`Found`]).

use pager_client::probe::Problem;

/// One donor as attach checked it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub name: String,
    pub address: String,
    /// Why it cannot take pages now; `None`: it can.
    pub problem: Option<Problem>,
}

/// What discovery brought while attach checked (`--discover`,
/// `--discover-domain`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Found {
    /// Where it looked: "multicast DNS", "DNS domain lab.example".
    pub through: Vec<String>,
    /// Donors found and admitted (with a lab key: their signed status
    /// verified), checked as the given ones are.
    pub admitted: Vec<Checked>,
    /// Donors found and not admitted: name, address, why.
    pub refused: Vec<(String, String, String)>,
    /// Donors whose records are past their lease: name, why.
    pub expired: Vec<(String, String)>,
    /// What went wrong finding donors (a DNS server that does not answer).
    pub errors: Vec<String>,
}

impl Found {
    /// "1 donor found through DNS domain lab.test (d1 at 127.0.0.5:10809)".
    fn summary(&self) -> String {
        let through = self.through.join(" and ");
        if self.admitted.is_empty() {
            return format!("no donor found and admitted through {through}");
        }
        let n = self.admitted.len();
        let list: Vec<String> = self
            .admitted
            .iter()
            .map(|c| format!("{} at {}", c.name, c.address))
            .collect();
        format!(
            "{n} donor{} found through {through} ({})",
            if n == 1 { "" } else { "s" },
            list.join(", ")
        )
    }

    fn notes(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .refused
            .iter()
            .map(|(n, a, why)| format!("found {n} at {a}, not admitted: {why}"))
            .collect();
        out.extend(
            self.expired
                .iter()
                .map(|(n, why)| format!("found {n}, not used: {why}")),
        );
        out.extend(self.errors.iter().map(|e| format!("discovery: {e}")));
        out
    }
}

/// What attach does with the donors it checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Enough donors take pages; the others' reasons, to print as warnings.
    Enough { warnings: Vec<String> },
    /// Too few for a unit: why, naming each donor that cannot.
    TooFew(String),
}

fn line(c: &Checked) -> Option<String> {
    let who = if c.name == c.address {
        format!("donor {}", c.name)
    } else {
        format!("donor {} ({})", c.name, c.address)
    };
    c.problem.as_ref().map(|p| format!("{who}: {p}"))
}

/// Whether `needed` donors take pages (the mode's members; 0 with a
/// fallback file), for a device of `mode`: of those given (`checked`) and
/// those discovery `found` and admitted.
pub fn verdict(checked: &[Checked], found: Option<&Found>, needed: usize, mode: &str) -> Verdict {
    let admitted = found.map_or(&[][..], |f| &f.admitted[..]);
    let usable = checked
        .iter()
        .chain(admitted)
        .filter(|c| c.problem.is_none())
        .count();
    let mut lines: Vec<String> = checked.iter().chain(admitted).filter_map(line).collect();
    if usable >= needed {
        return Verdict::Enough { warnings: lines };
    }
    let on = if needed == 1 {
        "a donor".to_string()
    } else {
        format!("{needed} distinct donors")
    };
    let head = if let Some(f) = found {
        lines.extend(f.notes());
        let given = match checked.len() {
            0 => "none given (--donor, --donors-file)".to_string(),
            n => format!(
                "{} of the {n} given",
                checked.iter().filter(|c| c.problem.is_none()).count()
            ),
        };
        format!(
            "mode {mode} places each unit on {on}, and {usable} can take pages now: {given}; {}",
            f.summary()
        )
    } else if checked.is_empty() {
        format!(
            "mode {mode} places each unit on {on}, and no donor was given (--donor, --donors-file)"
        )
    } else {
        format!(
            "mode {mode} places each unit on {on}, and {usable} of the {} given can take pages now",
            checked.len()
        )
    };
    let mut text = head;
    for l in lines {
        text.push_str("\n  ");
        text.push_str(&l);
    }
    Verdict::TooFew(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(name: &str, problem: Option<Problem>) -> Checked {
        Checked {
            name: name.into(),
            address: format!("{name}:10809"),
            problem,
        }
    }

    #[test]
    fn a_donor_named_by_its_address_is_named_once() {
        let mut one = c("d1", Some(Problem::Unreachable("down".into())));
        one.name = one.address.clone();
        match verdict(&[one], None, 1, "none") {
            Verdict::TooFew(t) => {
                assert!(
                    t.starts_with("mode none places each unit on a donor, and 0 of the 1"),
                    "{t}"
                );
                assert!(t.ends_with("\n  donor d1:10809: down"), "{t}");
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn too_few_names_every_donor_that_cannot() {
        let checked = [
            c("d1", None),
            c(
                "d2",
                Some(Problem::Unreachable("nothing listens at d2:10809".into())),
            ),
            c("d3", Some(Problem::NoRoom("d3:10809 is draining".into()))),
        ];
        match verdict(&checked, None, 3, "parity") {
            Verdict::TooFew(t) => {
                assert!(
                    t.starts_with(
                        "mode parity places each unit on 3 distinct donors, and 1 of the 3 given"
                    ),
                    "{t}"
                );
                assert!(
                    t.contains("\n  donor d2 (d2:10809): nothing listens at d2:10809"),
                    "{t}"
                );
                assert!(
                    t.contains("\n  donor d3 (d3:10809): d3:10809 is draining"),
                    "{t}"
                );
                assert!(!t.contains("donor d1"), "{t}");
            }
            v => panic!("{v:?}"),
        }
        // Mirror needs two: enough, with d2 and d3 as warnings.
        match verdict(&checked[..2], None, 1, "none") {
            Verdict::Enough { warnings } => assert_eq!(warnings.len(), 1),
            v => panic!("{v:?}"),
        }
        assert!(
            matches!(verdict(&[], None, 2, "mirror"), Verdict::TooFew(t) if t.contains("no donor was given"))
        );
        assert_eq!(
            verdict(&[], None, 0, "none"),
            Verdict::Enough { warnings: vec![] }
        );
    }

    #[test]
    fn discovered_donors_count_and_too_few_names_what_discovery_saw() {
        let mut f = Found {
            through: vec!["DNS domain lab.test".into()],
            admitted: vec![Checked {
                name: "d1".into(),
                address: "127.0.0.5:10809".into(),
                problem: None,
            }],
            refused: vec![(
                "forged".into(),
                "127.0.0.9:10809".into(),
                "status not verified with the lab key: bad MAC".into(),
            )],
            expired: vec![("d3".into(), "domain lab.test: expired: ...".into())],
            errors: vec!["domain lab.test: d4._netpager._tcp.lab.test: no SRV record".into()],
        };
        match verdict(&[], Some(&f), 2, "mirror") {
            Verdict::TooFew(t) => {
                assert!(
                    t.starts_with("mode mirror places each unit on 2 distinct donors, and 1 can take pages now: none given (--donor, --donors-file); 1 donor found through DNS domain lab.test (d1 at 127.0.0.5:10809)"),
                    "{t}"
                );
                assert!(
                    t.contains(
                        "\n  found forged at 127.0.0.9:10809, not admitted: status not verified"
                    ),
                    "{t}"
                );
                assert!(
                    t.contains("\n  found d3, not used: domain lab.test: expired"),
                    "{t}"
                );
                assert!(t.contains("\n  discovery: domain lab.test: d4"), "{t}");
            }
            v => panic!("{v:?}"),
        }
        // A given donor and a discovered one make a mirror.
        assert!(matches!(
            verdict(&[c("g1", None)], Some(&f), 2, "mirror"),
            Verdict::Enough { .. }
        ));
        // An admitted donor that cannot take pages counts for nothing and
        // says why.
        f.admitted[0].problem = Some(Problem::NoRoom("d1 is draining".into()));
        match verdict(&[c("g1", None)], Some(&f), 2, "mirror") {
            Verdict::TooFew(t) => {
                assert!(
                    t.contains("and 1 can take pages now: 1 of the 1 given; 1 donor found"),
                    "{t}"
                );
                assert!(
                    t.contains("\n  donor d1 (127.0.0.5:10809): d1 is draining"),
                    "{t}"
                );
            }
            v => panic!("{v:?}"),
        }
        f.admitted.clear();
        match verdict(&[], Some(&f), 1, "none") {
            Verdict::TooFew(t) => assert!(
                t.contains("no donor found and admitted through DNS domain lab.test"),
                "{t}"
            ),
            v => panic!("{v:?}"),
        }
    }
}
