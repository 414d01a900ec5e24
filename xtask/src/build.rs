//! `cargo xtask build`: the `ratelimit` binary. Its build script (ratelimit-userspace/build.rs)
//! compiles the XDP program with nightly and bpf-linker and embeds it, so one cargo build does both.

use std::path::PathBuf;

use anyhow::Result;

use crate::{cmd, setup};

/// Build the `ratelimit` binary, with the XDP program inside it.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Build with optimizations, into target/release (the XDP program is always optimized).
    #[arg(long)]
    pub release: bool,
}

pub fn run(opts: &Options) -> Result<()> {
    setup::ensure()?;
    build(opts.release)?;
    Ok(())
}

/// Builds ratelimit-userspace (after [`setup::ensure`]) and returns the path of the binary.
pub fn build(release: bool) -> Result<PathBuf> {
    let mut cargo = cmd::cargo();
    cargo.args(["build", "--package", "ratelimit-userspace"]);
    if release {
        cargo.arg("--release");
    }
    cmd::run_step(
        "Building ratelimit (its build script compiles the XDP program with nightly and bpf-linker)",
        &mut cargo,
    )?;
    let profile = if release { "release" } else { "debug" };
    Ok(cmd::target_dir().join(profile).join("ratelimit"))
}
