//! What `pagerctl attach` concludes from checking its donors before it
//! creates the device (`pager_client::probe` checks each one): whether the
//! mode can place a unit, and if not, every donor's reason in words.

use pager_client::probe::Problem;

/// One donor as attach checked it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub name: String,
    pub address: String,
    /// Why it cannot take pages now; `None`: it can.
    pub problem: Option<Problem>,
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
/// fallback file), for a device of `mode`.
pub fn verdict(checked: &[Checked], needed: usize, mode: &str) -> Verdict {
    let usable = checked.iter().filter(|c| c.problem.is_none()).count();
    let lines: Vec<String> = checked.iter().filter_map(line).collect();
    if usable >= needed {
        return Verdict::Enough { warnings: lines };
    }
    let on = if needed == 1 {
        "a donor".to_string()
    } else {
        format!("{needed} distinct donors")
    };
    let head = if checked.is_empty() {
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
        match verdict(&[one], 1, "none") {
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
        match verdict(&checked, 3, "parity") {
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
        match verdict(&checked[..2], 1, "none") {
            Verdict::Enough { warnings } => assert_eq!(warnings.len(), 1),
            v => panic!("{v:?}"),
        }
        assert!(
            matches!(verdict(&[], 2, "mirror"), Verdict::TooFew(t) if t.contains("no donor was given"))
        );
        assert_eq!(
            verdict(&[], 0, "none"),
            Verdict::Enough { warnings: vec![] }
        );
    }
}
