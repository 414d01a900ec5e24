//! `cargo xtask bench`: measures the XDP program's per-packet cost and throughput against its
//! floor, nftables and iptables, and writes `target/bench/results.json` (see BENCHMARKS.md).
//!
//! This module sets up the toolchain, builds the agent and the benchmark runner in release mode,
//! then runs the runner (`src/bench/main.rs`, binary `ratelimit-bench`), which does the measuring.
//! The runner is a binary of its own, behind the `bench` feature, for the reason the demo driver
//! is (see src/demo.rs): it uses the test bed, which needs the eBPF toolchain that setup installs.

use std::{
    ffi::OsString,
    process::Command,
    sync::{atomic::AtomicBool, Arc},
};

use anyhow::{bail, Context as _, Result};

use crate::{build, cmd, setup};

/// Measure the XDP program's per-packet cost and throughput (needs root; about 3 minutes).
///
/// In-kernel cost per packet through BPF_PROG_TEST_RUN against an XDP_PASS floor; packets per
/// second over a veth pair from a live-frames generator, for the limiter, a drop-all floor, an
/// XDP_PASS receiver, nftables and iptables, with one hot source and with random sources; the
/// agent's CPU and memory; rule update latency with 10,000 rules. Prints a table and writes
/// `target/bench/results.json`. Not a test: nothing fails on a slow result.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Arguments for the runner, after `--`: `--runs 7`, `--only kernel,e2e`, `--quick`,
    /// `--json PATH`, `--cpu N` (`cargo xtask bench -- --help` lists them).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<OsString>,
}

pub fn run(opts: &Options) -> Result<()> {
    let help = opts.args.iter().any(|a| a == "--help" || a == "-h");
    if !help && !setup::is_root()? {
        bail!(
            "`cargo xtask bench` needs root: it creates network namespaces and loads XDP programs \
             (CAP_NET_ADMIN, CAP_BPF). Run it as root, e.g. `sudo env \"PATH=$PATH\" cargo xtask bench`"
        );
    }
    setup::ensure()?;
    let agent = build::build(true)?;

    let mut cargo = cmd::cargo();
    cargo.args([
        "build",
        "--release",
        "--package",
        "xtask",
        "--features",
        "bench",
        "--bin",
        "ratelimit-bench",
    ]);
    cmd::run_step(
        "Building the benchmark runner in release mode (its measurements run in this process)",
        &mut cargo,
    )?;
    let runner = cmd::target_dir().join("release").join("ratelimit-bench");

    let mut bench = Command::new(&runner);
    bench
        .current_dir(cmd::workspace_root())
        // The agent measurement runs this `ratelimit` (the test bed reads RATELIMIT_BIN).
        .env("RATELIMIT_BIN", &agent)
        .args(&opts.args);
    if !opts
        .args
        .iter()
        .any(|a| a.to_string_lossy().starts_with("--json"))
    {
        bench
            .arg("--json")
            .arg(cmd::target_dir().join("bench").join("results.json"));
    }
    cmd::announce("Running the benchmark (Ctrl-C stops it between measurements and cleans up)");
    eprintln!("    $ {}", cmd::display(&bench));
    // Ctrl-C reaches the runner too (same process group): it stops and removes what it made.
    // Here it only must not end this process before the runner has done so.
    let interrupted = Arc::new(AtomicBool::new(false));
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        signal_hook::flag::register(sig, Arc::clone(&interrupted))
            .with_context(|| format!("installing a handler for signal {sig}"))?;
    }
    let status = bench
        .status()
        .with_context(|| format!("starting the benchmark runner {}", runner.display()))?;
    if !status.success() {
        bail!("the benchmark failed ({status}); see above");
    }
    Ok(())
}
