//! `cargo xtask test`: the project's test command (README, CI). Sets up the machine, then runs
//! every unit test and the root-only integration tests, which create network namespaces and veth
//! pairs and load XDP programs.

use std::ffi::OsString;

use anyhow::{bail, Context as _, Result};

use crate::{cmd, lanes, setup};

/// Run the unit and integration tests; needs root.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Arguments for `cargo test`, after `--`: a test name filter, `-p tests`, `-- --nocapture`.
    /// With them, plain `cargo test ARGS`, one binary after another.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<OsString>,
    /// Run the test binaries one after another (`cargo test`), not in two lanes.
    #[arg(long)]
    pub one_lane: bool,
}

pub fn run(opts: &Options) -> Result<()> {
    if !setup::is_root()? {
        bail!(
            "`cargo xtask test` needs root: the integration tests create network namespaces and veth \
             pairs and load XDP programs (CAP_NET_ADMIN, CAP_BPF). Run it as root, e.g. \
             `sudo env \"PATH=$PATH\" cargo xtask test`"
        );
    }
    cmd::announce("Setting up the toolchain and system packages (cargo xtask setup)");
    setup::ensure().context("setup failed, so no tests ran")?;

    // No package flag: cargo takes the workspace's default-members, i.e. every crate but
    // ratelimit-ebpf, which only builds for bpfel-unknown-none (`--workspace` would include it).
    // ratelimit-userspace's build script builds and embeds the XDP program that the tests load.
    // The end-to-end tests run the real `ratelimit` binary (target/debug/ratelimit) as an agent
    // inside network namespaces; `cargo test` does not build binaries of other packages.
    let mut build = cmd::cargo();
    build.args([
        "build",
        "--package",
        "ratelimit-userspace",
        "--bin",
        "ratelimit",
    ]);
    cmd::run_step(
        "Building the ratelimit binary the end-to-end tests run",
        &mut build,
    )?;

    if !opts.args.is_empty() || opts.one_lane {
        let mut cargo = cmd::cargo();
        cargo.args(["test", "--no-fail-fast"]).args(&opts.args);
        let status = cmd::run_step_status(
            "Running the unit tests and the integration tests (cargo test)",
            &mut cargo,
        )?;
        if !status.success() {
            bail!("tests failed ({status}): see the `test result:` lines and failures above");
        }
    } else {
        let binaries = lanes::build()?;
        let mut doc = cmd::cargo();
        doc.args(["test", "--doc"]);
        let doc_ok = cmd::run_step_status("Running the documentation tests", &mut doc)?.success();
        lanes::run(&binaries)?;
        if !doc_ok {
            bail!("documentation tests failed: see their `test result:` lines above");
        }
    }
    cmd::announce("test: all passed");
    Ok(())
}
