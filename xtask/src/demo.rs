//! `cargo xtask demo`: the rate limiter at work between two throwaway network namespaces, a
//! flooding client and a polite one, with live counters; then everything it made is removed.
//!
//! This module sets up the toolchain, builds the agent, then builds and hands over to the demo
//! driver (`src/bin/ratelimit-demo/`), which does the demo itself. The driver is a binary of its
//! own, behind the `demo` feature, because it uses the test bed (crate `tests`), which depends on
//! ratelimit-userspace and so on the eBPF toolchain: were xtask to depend on it, xtask could not
//! be compiled on a fresh machine to run the setup that installs that toolchain.

use std::{os::unix::process::CommandExt as _, process::Command};

use anyhow::{bail, Context as _, Result};

use crate::{build, cmd, setup};

/// Show the rate limiter at work in throwaway network namespaces (needs root).
///
/// A flooding client (198.18.0.1) and a polite one (198.18.0.2) send UDP to a server namespace
/// where the real agent runs with an embedded config: 1000 packets/s with a burst of 500 per
/// source. Prints what was sent, received and dropped every second, and a summary. Ctrl-C stops
/// it early; either way the namespaces, config file and agent are gone when it exits.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// How long the clients send, in seconds.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Packets per second the flooding client sends.
    #[arg(long, default_value_t = 15_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub flood_pps: u64,
    /// Packets per second the polite client sends.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub polite_pps: u64,
}

pub fn run(opts: &Options) -> Result<()> {
    if !setup::is_root()? {
        bail!(
            "`cargo xtask demo` needs root: it creates network namespaces and a veth pair and loads \
             an XDP program (CAP_NET_ADMIN, CAP_BPF). Run it as root, e.g. \
             `sudo env \"PATH=$PATH\" cargo xtask demo`"
        );
    }
    setup::ensure()?;
    let agent = build::build(false)?;

    let mut cargo = cmd::cargo();
    cargo.args([
        "build",
        "--package",
        "xtask",
        "--features",
        "demo",
        "--bin",
        "ratelimit-demo",
    ]);
    cmd::run_step(
        "Building the demo driver (namespaces and traffic come from the test bed in tests/)",
        &mut cargo,
    )?;
    let driver = cmd::target_dir().join("debug").join("ratelimit-demo");

    let mut demo = Command::new(&driver);
    // The test bed's agent helpers run the `ratelimit` binary named by RATELIMIT_BIN.
    demo.env("RATELIMIT_BIN", &agent)
        .args(["--seconds", &opts.seconds.to_string()])
        .args(["--flood-pps", &opts.flood_pps.to_string()])
        .args(["--polite-pps", &opts.polite_pps.to_string()]);
    cmd::announce("Running the demo (Ctrl-C stops it early and still cleans up)");
    eprintln!("    $ {}", cmd::display(&demo));
    // exec, not spawn: the driver takes over this process, so Ctrl-C and `timeout -s INT` reach
    // it directly, it cleans up, and its exit status is the command's.
    let err = demo.exec();
    Err(err).with_context(|| format!("starting the demo driver {}", driver.display()))
}
