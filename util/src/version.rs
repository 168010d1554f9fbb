//! What `--version` prints on every netpager command: the package version
//! and the git commit it was built from.
//!
//! Both come from the environment at build time (`NETPAGER_VERSION`,
//! `NETPAGER_COMMIT`; the Makefile sets them from `scripts/version.sh`, so a
//! command and the package holding it name the same version). A plain
//! `cargo build` without them prints the crate's version and "unknown".
//! The [`version!`](crate::version!) macro reads the variables in the
//! calling crate, so a new commit rebuilds only the binaries that print it,
//! not every crate that depends on this one.

/// `VERSION (commit COMMIT)`, from the build environment or the fallbacks.
pub fn text(crate_version: &str, version: Option<&str>, commit: Option<&str>) -> String {
    let version = version.filter(|v| !v.is_empty()).unwrap_or(crate_version);
    let commit = commit.filter(|c| !c.is_empty()).unwrap_or("unknown");
    format!("{version} (commit {commit})")
}

/// The calling binary's version text as a `&'static str`, for clap's
/// `#[command(version = netpager_util::version!())]`.
#[macro_export]
macro_rules! version {
    () => {{
        static TEXT: ::std::sync::OnceLock<String> = ::std::sync::OnceLock::new();
        TEXT.get_or_init(|| {
            $crate::version::text(
                env!("CARGO_PKG_VERSION"),
                option_env!("NETPAGER_VERSION"),
                option_env!("NETPAGER_COMMIT"),
            )
        })
        .as_str()
    }};
}

#[cfg(test)]
mod tests {
    use super::text;

    #[test]
    fn build_environment_wins() {
        assert_eq!(
            text(
                "0.1.0",
                Some("0.1.0+git20261126033800.957df37"),
                Some("957df37ab")
            ),
            "0.1.0+git20261126033800.957df37 (commit 957df37ab)"
        );
    }

    #[test]
    fn missing_or_empty_falls_back() {
        assert_eq!(text("0.1.0", None, None), "0.1.0 (commit unknown)");
        assert_eq!(text("0.1.0", Some(""), Some("")), "0.1.0 (commit unknown)");
    }
}
