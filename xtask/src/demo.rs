//! `cargo xtask demo`: shows the rate limiter at work between network namespaces.

use anyhow::{bail, Result};

use crate::{build, setup};

/// Show the rate limiter at work in network namespaces (needs root).
#[derive(Debug, clap::Args)]
pub struct Options {}

pub fn run(_opts: &Options) -> Result<()> {
    setup::ensure()?;
    let _binary = build::build(false)?;
    // TODO(lead): the demo itself: namespaces and a veth pair, an agent with examples/ratelimit.toml,
    // a polite and a noisy client, and what `ratelimit top` / `stats` show while it runs.
    bail!("`cargo xtask demo` is not implemented yet")
}
