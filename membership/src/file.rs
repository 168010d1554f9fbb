//! The donors file: one donor spec a line (as `pagerctl attach --donor`
//! takes it), `#` starts a comment, blank lines are ignored. A client re-reads
//! it while attached; a file that does not parse changes nothing, and its
//! error names the line.

use std::path::{Path, PathBuf};

use crate::spec::DonorSpec;

/// Why a donors file was not taken, naming the file and line.
#[derive(Debug, thiserror::Error)]
pub enum DonorsFileError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}, line {line}: {reason}")]
    Line {
        path: PathBuf,
        line: usize,
        reason: String,
    },
}

/// Parses a donors file's `text` (`path` only names it in errors).
pub fn parse_donors_file(path: &Path, text: &str) -> Result<Vec<DonorSpec>, DonorsFileError> {
    parse_lines(
        path,
        text,
        |l| l.parse::<DonorSpec>().map_err(|e| e.reason),
        |s| s.name.clone(),
    )
}

/// Parses a file of one donor a line by the donors file's rules, with the
/// line syntax of the daemon that reads it (prefetchd's `--donor` differs
/// from pagerctl's): `parse` reads one line's donor, `name` names it, and
/// no two lines may name the same donor.
pub fn parse_lines<T>(
    path: &Path,
    text: &str,
    parse: impl Fn(&str) -> Result<T, String>,
    name: impl Fn(&T) -> String,
) -> Result<Vec<T>, DonorsFileError> {
    Ok(parse_numbered(path, text, parse, name)?
        .into_iter()
        .map(|(_, t)| t)
        .collect())
}

/// [`parse_lines`], each donor with its line number (for messages about
/// a line that parsed but could not be applied).
fn parse_numbered<T>(
    path: &Path,
    text: &str,
    parse: impl Fn(&str) -> Result<T, String>,
    name: impl Fn(&T) -> String,
) -> Result<Vec<(usize, T)>, DonorsFileError> {
    let mut out: Vec<(usize, String, T)> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let err = |reason: String| DonorsFileError::Line {
            path: path.to_path_buf(),
            line,
            reason,
        };
        let content = raw.split('#').next().unwrap_or_default().trim();
        if content.is_empty() {
            continue;
        }
        if content.split_whitespace().nth(1).is_some() {
            return Err(err(format!(
                "{content:?}: one donor spec a line (no spaces inside a spec)"
            )));
        }
        let item = parse(content).map_err(err)?;
        let n = name(&item);
        if let Some((first, _, _)) = out.iter().find(|(_, m, _)| *m == n) {
            return Err(err(format!("donor {n:?} is already on line {first}")));
        }
        out.push((line, n, item));
    }
    Ok(out.into_iter().map(|(l, _, s)| (l, s)).collect())
}

/// Reads and parses the donors file at `path`, each donor with its line.
pub fn read_donors_file_lines(path: &Path) -> Result<Vec<(usize, DonorSpec)>, DonorsFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| DonorsFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_donors_file_lines(path, &text)
}

/// Whether a follower of the donors file takes the text `read` now: none
/// was taken yet, it is the text last taken, or the follower's pass before
/// read it too (`changing`). A file rewritten in place (truncated, then
/// written, as `echo ... >` does) can be read in between, empty or cut
/// short; taken, that text would remove donors the file still lists. Two
/// passes in a row that read the same text make it the file's.
pub fn settled_text(read: &str, taken: Option<&str>, changing: Option<&str>) -> bool {
    taken.is_none_or(|t| t == read) || changing == Some(read)
}

/// Parses the text of the donors file at `path`: each donor with its line.
pub fn parse_donors_file_lines(
    path: &Path,
    text: &str,
) -> Result<Vec<(usize, DonorSpec)>, DonorsFileError> {
    parse_numbered(
        path,
        text,
        |l| l.parse::<DonorSpec>().map_err(|e| e.reason),
        |s| s.name.clone(),
    )
}

/// Reads and parses the donors file at `path`.
pub fn read_donors_file(path: &Path) -> Result<Vec<DonorSpec>, DonorsFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| DonorsFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_donors_file(path, &text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pass by pass, what a follower does with each text it reads: the
    /// text it takes (`Some`), or nothing yet.
    fn follow(reads: &[&str]) -> Vec<Option<String>> {
        let (mut taken, mut changing): (Option<String>, Option<String>) = (None, None);
        reads
            .iter()
            .map(|&read| {
                if settled_text(read, taken.as_deref(), changing.as_deref()) {
                    changing = None;
                    taken = Some(read.to_string());
                    Some(read.to_string())
                } else {
                    changing = Some(read.to_string());
                    None
                }
            })
            .collect()
    }

    #[test]
    fn a_file_read_while_written_in_place_is_not_taken() {
        let full = "a:1,name=a\nb:1,name=b\n";
        let cut = "a:1,name=a\n";
        let t = |s: &str| Some(s.to_string());
        // The first text at once; a torn read (empty, or cut at a line)
        // between two reads of the whole file is never taken.
        assert_eq!(
            follow(&[full, "", full, cut, full, full]),
            [t(full), None, t(full), None, t(full), t(full)]
        );
        // A real change is taken at the second pass that reads it.
        assert_eq!(follow(&[cut, full, full]), [t(cut), None, t(full)]);
        // Two torn reads in a row of different texts take neither.
        assert_eq!(
            follow(&[full, "", cut, full]),
            [t(full), None, None, t(full)]
        );
    }

    fn parse(text: &str) -> Result<Vec<DonorSpec>, DonorsFileError> {
        parse_donors_file(Path::new("/etc/netpager/donors"), text)
    }

    #[test]
    fn comments_blank_lines_and_specs() {
        let d = parse(
            "# lab donors\n\n127.0.0.2:10809,status=127.0.0.2:7070  # idle1\n  127.0.0.3:10809/x@64M\n",
        )
        .unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].status.as_deref(), Some("127.0.0.2:7070"));
        assert_eq!(d[1].name, "127.0.0.3:10809/x@64M");
        assert!(parse("# nothing\n").unwrap().is_empty());
    }

    #[test]
    fn bad_lines_are_named_by_number() {
        for (text, line, needle) in [
            ("127.0.0.2:1\nnot-a-spec\n", 2, "no :PORT"),
            ("127.0.0.2:1\n\n127.0.0.2:1\n", 3, "already on line 1"),
            ("127.0.0.2:1 127.0.0.3:1\n", 1, "one donor spec a line"),
            ("# c\n127.0.0.2:1,bogus=1\n", 2, "unknown option"),
        ] {
            let e = parse(text).unwrap_err();
            let msg = e.to_string();
            assert!(
                matches!(e, DonorsFileError::Line { line: l, .. } if l == line),
                "{text:?}: {msg}"
            );
            assert!(msg.contains("/etc/netpager/donors, line"), "{msg}");
            assert!(msg.contains(needle), "{text:?} gave {msg:?}");
        }
    }

    #[test]
    fn a_missing_file_names_its_path() {
        let e = read_donors_file(Path::new("/nonexistent/donors")).unwrap_err();
        assert!(e.to_string().starts_with("/nonexistent/donors: "), "{e}");
    }
}
