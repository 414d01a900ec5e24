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
