//! Running the real `ratelimit` binary as an agent inside a test namespace.

use std::path::PathBuf;

/// The `ratelimit` binary the tests run: `$RATELIMIT_BIN`, else `target/debug/ratelimit` of this
/// workspace (built by `cargo xtask test` before the tests run).
///
/// # Panics
/// If it does not exist, with a message saying how to build it.
#[must_use]
pub fn agent_binary() -> PathBuf {
    let path = std::env::var_os("RATELIMIT_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/ratelimit"),
        PathBuf::from,
    );
    assert!(
        path.exists(),
        "{} does not exist: run the tests with `cargo xtask test` (it builds the binary first) or \
         `cargo build -p ratelimit-userspace` first",
        path.display()
    );
    path
}

/// The release build of the `ratelimit` binary: `$RATELIMIT_RELEASE_BIN`, else
/// `target/release/ratelimit` of this workspace (built by `cargo xtask test` before the tests
/// run; by hand, `cargo build --release -p ratelimit-userspace --bin ratelimit` first, or it may be
/// stale). For tests whose figures depend on the agents' speed: eight debug agents on a 2-core
/// machine starve each other, and a sync round that runs late moves a cluster's admissions.
///
/// # Panics
/// If it does not exist, with a message saying how to build it.
#[must_use]
pub fn release_agent_binary() -> PathBuf {
    let path = std::env::var_os("RATELIMIT_RELEASE_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/ratelimit"),
        PathBuf::from,
    );
    assert!(
        path.exists(),
        "{} does not exist: run the tests with `cargo xtask test` (it builds the binary first) or \
         `cargo build --release -p ratelimit-userspace --bin ratelimit` first",
        path.display()
    );
    path
}
