//! `cargo xtask lint`: formatting, clippy on the user-space crates, a separate clippy run on the
//! eBPF crate for its own target with nightly, and a check that the fuzz targets (a workspace of
//! their own, built by CI's fuzzing) still compile against the crates they drive. Runs all four
//! and reports each.

use anyhow::{bail, Result};

use crate::{cmd, setup};

/// Check formatting and run clippy with warnings as errors.
#[derive(Debug, clap::Args)]
pub struct Options {}

pub fn run(_opts: &Options) -> Result<()> {
    setup::ensure()?;

    let mut fmt = cmd::cargo();
    fmt.args(["fmt", "--all", "--check"]);

    let mut clippy = cmd::cargo();
    clippy
        .args([
            "clippy",
            "--workspace",
            "--exclude",
            "ratelimit-ebpf",
            // Every crate but the eBPF one: xtask, the agent, the test bed, the benchmark
            // runner (bench/) and the demo driver (demo/), their tests included.
            "--all-targets",
        ])
        .args(["--", "-D", "warnings"]);

    // A target dir of its own: build-std and the bpf target share nothing with the host builds,
    // and this keeps it apart from target/ebpf, which the build script uses.
    let mut ebpf_clippy = cmd::nightly_cargo();
    ebpf_clippy
        .args(["clippy", "--package", "ratelimit-ebpf"])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .arg("--target-dir")
        .arg(cmd::target_dir().join("ebpf-clippy"))
        .args(["--", "-D", "warnings"])
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            cmd::ebpf_build::EBPF_RUSTFLAGS.join("\x1f"),
        );

    // The fuzz crate is outside the workspace (cargo-fuzz builds it with sanitizers), so the
    // clippy run above does not see it: a changed struct broke a fuzz target once, found only by
    // CI's fuzzing. A plain check with nightly, in a target dir of its own.
    let mut fuzz_check = cmd::nightly_cargo();
    fuzz_check
        .args(["check", "--bins", "--manifest-path"])
        .arg(cmd::workspace_root().join("fuzz").join("Cargo.toml"))
        .arg("--target-dir")
        .arg(cmd::target_dir().join("fuzz-check"))
        .env("RATELIMIT_EBPF_SKIP", "1");

    let steps = [
        ("Checking formatting (cargo fmt --check)", fmt),
        ("Running clippy on the user-space crates", clippy),
        (
            "Running clippy on the eBPF crate (nightly, bpfel-unknown-none)",
            ebpf_clippy,
        ),
        (
            "Checking that the fuzz targets compile (nightly)",
            fuzz_check,
        ),
    ];
    let mut failed = Vec::new();
    for (description, mut command) in steps {
        if !cmd::run_step_status(description, &mut command)?.success() {
            failed.push(description);
        }
    }
    if !failed.is_empty() {
        bail!("lint failed: {}", failed.join("; "));
    }
    cmd::announce("lint: all passed");
    Ok(())
}
