// How the XDP program is built, in one place: `include!`d by ratelimit-userspace/build.rs (the
// object the agent embeds), xtask (lint, the bench's variant) and the tests (their variants), so
// that every object and every check of it sees the same flags. Not part of the eBPF crate itself.
//
// `-C target-cpu=v3` is what makes LLVM emit the 64-bit compare-and-swap the bucket update needs
// (see docs/toolchain.md, "Atomics in eBPF Rust"); `cargo xtask setup` installs the nightly
// rust-src and bpf-linker the build needs.

/// The eBPF crate's flags (as `CARGO_ENCODED_RUSTFLAGS`, joined by `\x1f`).
#[allow(dead_code)]
pub(crate) const EBPF_RUSTFLAGS: [&str; 4] = [
    "-Ctarget-cpu=v3",
    "-Cdebuginfo=2",
    "-Clink-arg=--btf",
    "--cfg=bpf_target_arch=\"x86_64\"",
];

/// `rustup run nightly cargo` in `workspace`, with the variables a calling cargo (a build script,
/// xtask, a test) exports removed: `CARGO` in particular would make nightly's cargo-clippy call
/// stable cargo, which rejects `-Z build-std`; a caller's target dir or flags would mix the two
/// builds.
#[allow(dead_code)]
pub(crate) fn nightly_cargo_in(workspace: &std::path::Path) -> std::process::Command {
    let mut cmd = std::process::Command::new("rustup");
    cmd.args(["run", "nightly", "cargo"]).current_dir(workspace);
    for key in [
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_MAKEFLAGS",
        "RUSTUP_TOOLCHAIN",
        "CARGO",
    ] {
        cmd.env_remove(key);
    }
    cmd
}

/// The release build of the XDP program (`bpfel-unknown-none`, core built from source) with
/// ratelimit-ebpf's `features`, into `target_dir`; the object is then at
/// [`ebpf_object`]`(target_dir)`.
#[allow(dead_code)]
pub(crate) fn ebpf_build(
    workspace: &std::path::Path,
    target_dir: &std::path::Path,
    features: &[&str],
) -> std::process::Command {
    let mut cmd = nightly_cargo_in(workspace);
    cmd.args(["build", "--package", "ratelimit-ebpf", "--bin", "ratelimit"]);
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    cmd.args([
        "--release",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
    ])
    .arg("--target-dir")
    .arg(target_dir)
    .env("CARGO_ENCODED_RUSTFLAGS", EBPF_RUSTFLAGS.join("\x1f"));
    cmd
}

/// Where [`ebpf_build`] leaves the object.
#[allow(dead_code)]
pub(crate) fn ebpf_object(target_dir: &std::path::Path) -> std::path::PathBuf {
    target_dir.join("bpfel-unknown-none/release/ratelimit")
}
