//! `cargo xtask mutants`: mutation testing with cargo-mutants on the user-space modules that need
//! no root (the config parser, the compiler, the cluster's wire format, publishing and remote
//! tracking, the counters' report): each mutant of their code must make a unit test fail.
//! Not run by CI (it rebuilds the crate once per mutant: an hour or more on 2 cores).

use std::ffi::OsString;

use anyhow::{bail, Context as _, Result};

use crate::cmd;

/// The files mutated, relative to the workspace root.
const FILES: [&str; 20] = [
    "ratelimit-userspace/src/config/model.rs",
    "ratelimit-userspace/src/config/keywords.rs",
    "ratelimit-userspace/src/config/rule.rs",
    "ratelimit-userspace/src/config/validate.rs",
    "ratelimit-userspace/src/config/parse.rs",
    "ratelimit-userspace/src/config/raw.rs",
    "ratelimit-userspace/src/config/cluster.rs",
    "ratelimit-userspace/src/config/lists.rs",
    "ratelimit-userspace/src/config/write.rs",
    "ratelimit-userspace/src/config/error.rs",
    "ratelimit-userspace/src/compile/mod.rs",
    "ratelimit-userspace/src/compile/compiled.rs",
    "ratelimit-userspace/src/compile/record.rs",
    "ratelimit-userspace/src/compile/prefixes.rs",
    "ratelimit-userspace/src/compile/ids.rs",
    "ratelimit-userspace/src/compile/error.rs",
    "ratelimit-userspace/src/cluster/remote.rs",
    "ratelimit-userspace/src/cluster/wire.rs",
    "ratelimit-userspace/src/cluster/publish.rs",
    "ratelimit-userspace/src/stats.rs",
];

/// Run cargo-mutants on the modules that need no root; writes `target/mutants.out/`.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Further arguments for `cargo mutants`, after `--`: `--list`, `--file PATH` (only that
    /// file), `-j 2`, `--shard 1/4`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<OsString>,
}

pub fn run(opts: &Options) -> Result<()> {
    let mut probe = cmd::cargo();
    probe.args(["mutants", "--version"]);
    if cmd::output(&mut probe).is_none_or(|(status, _, _)| !status.success()) {
        bail!("cargo-mutants is not installed: `cargo install cargo-mutants --locked`");
    }
    let out = cmd::target_dir();
    let mut mutants = cmd::cargo();
    mutants
        .current_dir(cmd::workspace_root())
        // The unit tests of these modules do not load the XDP program: skip building it.
        .env("RATELIMIT_EBPF_SKIP", "1")
        .args([
            "mutants",
            "--package",
            "ratelimit-userspace",
            "--no-shuffle",
        ])
        .arg("--output")
        .arg(&out);
    if !opts.args.iter().any(|a| a == "--file" || a == "-f") {
        for f in FILES {
            mutants.args(["--file", f]);
        }
    }
    mutants.args(&opts.args);
    let status = cmd::run_step_status(
        "Mutation testing (cargo mutants) of config, compile, cluster/{remote,wire,publish}, stats",
        &mut mutants,
    )
    .context("running cargo mutants")?;
    // cargo-mutants exits 2 when mutants were missed, 3 on timeouts: the summary says which.
    println!(
        "mutants: see {} (caught.txt, missed.txt, timeout.txt)",
        out.join("mutants.out").display()
    );
    if !status.success() {
        bail!("cargo mutants: {status}: missed or timed-out mutants are listed above");
    }
    Ok(())
}
