//! Builds the XDP program (`ratelimit-ebpf`) for `bpfel-unknown-none` with the nightly toolchain
//! and bpf-linker, and leaves the object at `$OUT_DIR/ratelimit.bpf.o` for `include_bytes!`.
//!
//! Written out rather than using aya-build so the eBPF flags live in one visible place,
//! ratelimit-ebpf/nightly_build.rs, which xtask and the tests include too. `cargo xtask setup`
//! installs what this needs.

use std::{env, path::PathBuf, process::Stdio};

use anyhow::{bail, Context as _, Result};

include!("../ratelimit-ebpf/nightly_build.rs");

fn main() -> Result<()> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").context("no manifest dir")?);
    let workspace = manifest_dir
        .parent()
        .context("no workspace dir")?
        .to_path_buf();
    let ebpf_dir = workspace.join("ratelimit-ebpf");
    let common_dir = workspace.join("ratelimit-common");
    let object = out_dir.join("ratelimit.bpf.o");

    println!("cargo::rerun-if-changed={}", ebpf_dir.display());
    println!(
        "cargo::rerun-if-changed={}",
        common_dir.join("src").display()
    );
    println!("cargo::rerun-if-env-changed=RATELIMIT_EBPF_SKIP");

    if env::var_os("RATELIMIT_EBPF_SKIP").is_some_and(|v| v == "1") {
        // For editing user-space code on a machine without the eBPF toolchain: the binary builds,
        // and loading the program fails with a message that says why.
        println!("cargo::warning=RATELIMIT_EBPF_SKIP=1: the XDP program is not built; the agent cannot load it");
        std::fs::write(&object, b"")?;
        return Ok(());
    }

    // A target dir of its own: the outer cargo holds the lock on the workspace's.
    let target_dir = workspace.join("target").join("ebpf");
    let mut cmd = ebpf_build(&workspace, &target_dir, &[]);
    cmd.stdout(Stdio::inherit()).stderr(Stdio::inherit());
    let status = cmd.status().context(
        "running `rustup run nightly cargo build` for ratelimit-ebpf (run `cargo xtask setup` first)",
    )?;
    if !status.success() {
        bail!("building the XDP program failed ({status}); `cargo xtask setup` installs the nightly rust-src and bpf-linker it needs");
    }
    let built = ebpf_object(&target_dir);
    std::fs::copy(&built, &object)
        .with_context(|| format!("copying {} to {}", built.display(), object.display()))?;
    Ok(())
}
