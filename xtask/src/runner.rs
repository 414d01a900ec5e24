//! How `cargo xtask bench` and `cargo xtask soak` start the benchmark runner (crate `bench/`,
//! binary `ratelimit-bench`): root checked, setup, the agent and the runner built in release mode,
//! then the runner runs with the agent in `RATELIMIT_BIN` until it exits. The runner is a crate of
//! its own for the reason the demo driver is (see src/demo.rs): it uses the test bed, which needs
//! the eBPF toolchain that setup installs.

use std::{
    ffi::OsString,
    fs,
    process::Command,
    sync::{atomic::AtomicBool, Arc},
};

use anyhow::{bail, Context as _, Result};

use crate::{build, cmd, setup};

/// How `cargo xtask bench` or `cargo xtask soak` runs the runner.
pub struct Runner<'a> {
    /// The xtask subcommand, for messages.
    pub command: &'static str,
    /// The runner's subcommand (`soak`), if any.
    pub subcommand: Option<&'static str>,
    /// File name of the JSON results in target/bench/, unless the arguments give `--json`.
    pub json: &'static str,
    /// What runs, for messages ("the benchmark").
    pub what: &'static str,
    /// Arguments for the runner, after `--`.
    pub args: &'a [OsString],
    /// Run a copy of the agent binary (target/bench/COMMAND-bin/ratelimit), not target/release/ratelimit itself: a
    /// long run's CLI calls then keep talking to the same build if target/release is rebuilt
    /// meanwhile.
    pub own_agent_copy: bool,
}

/// Checks for root, sets up the toolchain, builds the agent and the runner in release mode, and
/// runs the runner until it exits (Ctrl-C reaches it, and it cleans up).
pub fn run_runner(r: &Runner) -> Result<()> {
    let help = r.args.iter().any(|a| a == "--help" || a == "-h");
    if !help && !setup::is_root()? {
        bail!(
            "`cargo xtask {0}` needs root: it creates network namespaces and loads XDP programs \
             (CAP_NET_ADMIN, CAP_BPF). Run it as root, e.g. `sudo env \"PATH=$PATH\" cargo xtask {0}`",
            r.command
        );
    }
    setup::ensure()?;
    let mut agent = build::build(true)?;
    if r.own_agent_copy {
        // Still named `ratelimit` (the runner finds the agent's process by that name).
        let dir = cmd::target_dir()
            .join("bench")
            .join(format!("{}-bin", r.command));
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let (tmp, copy) = (dir.join("ratelimit.new"), dir.join("ratelimit"));
        fs::copy(&agent, &tmp).with_context(|| format!("copying {}", agent.display()))?;
        fs::rename(&tmp, &copy).with_context(|| format!("renaming {}", tmp.display()))?;
        agent = copy;
    }

    let without_cut = if r.subcommand.is_none() {
        Some(build_without_cut()?)
    } else {
        None
    };

    let mut cargo = cmd::cargo();
    cargo.args([
        "build",
        "--release",
        "--package",
        "ratelimit-bench",
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
        .args(r.subcommand)
        .args(r.args);
    if let Some(object) = &without_cut {
        // The A/B of the handling of cut packets (bench/src/kernel/cut.rs, `cut_ab`).
        bench.env("RATELIMIT_BENCH_WITHOUT_CUT", object);
    }
    if !r
        .args
        .iter()
        .any(|a| a.to_string_lossy().starts_with("--json"))
    {
        bench
            .arg("--json")
            .arg(cmd::target_dir().join("bench").join(r.json));
    }
    cmd::announce(&format!(
        "Running {} (Ctrl-C stops it and cleans up)",
        r.what
    ));
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
        bail!("{} failed ({status}); see above", r.what);
    }
    Ok(())
}

/// Builds the bench-only XDP object without the handling of cut packets (ratelimit-ebpf's feature
/// `bench-without-cut`) and returns its path. In a target dir of its own (target/ebpf-bench): in
/// target/ebpf it would overwrite the object the agent's build script copies.
fn build_without_cut() -> Result<std::path::PathBuf> {
    let target_dir = cmd::target_dir().join("ebpf-bench");
    // The flags of ratelimit-userspace/build.rs (the same file), so the two objects differ only by
    // the feature.
    let mut cargo =
        cmd::ebpf_build::ebpf_build(&cmd::workspace_root(), &target_dir, &["bench-without-cut"]);
    cmd::run_step(
        "Building the bench-only XDP object without the handling of cut packets",
        &mut cargo,
    )?;
    Ok(cmd::ebpf_build::ebpf_object(&target_dir))
}
