//! `cargo xtask demo`: the rate limiter at work between two throwaway network namespaces, a
//! flooding client and a polite one, with live counters; then everything it made is removed.
//!
//! This module sets up the toolchain, builds the agent, then builds and runs the demo driver
//! (crate `demo/`, binary `ratelimit-demo`), which does the demo itself, and passes Ctrl-C on to
//! it. The driver is a crate of its own because it uses the test bed (crate `tests`), which
//! depends on ratelimit-userspace and so on the eBPF toolchain: were xtask to depend on it, xtask
//! could not be compiled on a fresh machine to run the setup that installs that toolchain.

use std::{
    os::unix::process::CommandExt as _,
    process::Command,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    thread,
    time::Duration,
};

use anyhow::{bail, Context as _, Result};

use crate::{build, cmd, setup};

/// Signals passed on to the driver: each makes it stop early and clean up.
const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];
/// The driver's exit code after an interruption (128 + SIGINT, as a shell reports it).
const INTERRUPTED: i32 = 130;

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
        "ratelimit-demo",
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
        .args(["--polite-pps", &opts.polite_pps.to_string()])
        // A process group of its own, so that Ctrl-C (which the terminal sends to the whole
        // foreground group) reaches only this process, which passes it on to the driver alone: the
        // agent the driver starts must not see it, or it would detach while the clients still
        // send. The driver stops the clients first, then the agent.
        .process_group(0);
    cmd::announce("Running the demo (Ctrl-C stops it early and still cleans up)");
    eprintln!("    $ {}", cmd::display(&demo));
    let signal = Arc::new(AtomicUsize::new(0));
    for sig in FORWARDED {
        signal_hook::flag::register_usize(sig, Arc::clone(&signal), sig as usize)
            .with_context(|| format!("installing a handler for signal {sig}"))?;
    }
    let mut child = demo
        .spawn()
        .with_context(|| format!("starting the demo driver {}", driver.display()))?;
    let pid = libc::pid_t::try_from(child.id()).context("child pid out of range")?;
    let status = loop {
        if let Some(status) = child.try_wait().context("waiting for the demo driver")? {
            break status;
        }
        let sig = signal.swap(0, Ordering::SeqCst);
        if sig != 0 {
            // SAFETY: kill has no memory-safety preconditions; `pid` is our child, not yet reaped.
            unsafe { libc::kill(pid, sig as libc::c_int) };
        }
        thread::sleep(Duration::from_millis(20));
    };
    match status.code() {
        Some(0) => Ok(()),
        // Interrupted, and cleaned up: the driver said so. Exit as an interrupted command does.
        Some(INTERRUPTED) => std::process::exit(INTERRUPTED),
        _ => bail!("the demo failed ({status}); see above"),
    }
}
