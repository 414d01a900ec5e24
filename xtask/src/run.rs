//! `cargo xtask run -- ARGS`: builds, then runs `ratelimit ARGS`, e.g.
//! `cargo xtask run -- agent -c examples/ratelimit.toml`.

use std::{ffi::OsString, os::unix::process::CommandExt as _, process::Command};

use anyhow::{Context as _, Result};

use crate::{build, cmd, setup};

/// Build, then run `ratelimit` with the given arguments.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Build and run the optimized binary (target/release).
    #[arg(long)]
    pub release: bool,
    /// Arguments for `ratelimit`, best after `--`: `cargo xtask run -- agent -c FILE`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<OsString>,
}

pub fn run(opts: &Options) -> Result<()> {
    setup::ensure()?;
    let binary = build::build(opts.release)?;
    let mut ratelimit = Command::new(&binary);
    ratelimit.args(&opts.args);
    cmd::announce(&format!("Running {}", cmd::display(&ratelimit)));
    // Replace this process rather than wait on a child: Ctrl-C and other signals reach the agent
    // alone, it shuts down in its own time, and its exit status is ours.
    let err = ratelimit.exec();
    Err(err).with_context(|| format!("running {}", binary.display()))
}
