//! `cargo xtask package`: the Debian package (`target/debian/ratelimit_VERSION_ARCH.deb`), built by
//! cargo-deb from `[package.metadata.deb]` in ratelimit-userspace/Cargo.toml: the release binary,
//! the conffile, the systemd unit and maintainer scripts (packaging/debian/), and the man pages and
//! shell completions the binary writes itself (into target/release/package/ first).
//!
//! The tools it needs (cargo-deb) are installed by `cargo xtask setup` (see `tools.rs`).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use crate::{build, cmd, setup};

/// Build the Debian package (release binary, unit, conffile, man pages, completions).
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Copy the .deb into this directory too.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Package the debug build instead of the release one: the same contents (binary, unit,
    /// conffile, pages, completions) without the release build's minutes. For the packaging
    /// tests, which check what the package holds; never ship it.
    #[arg(long)]
    pub debug: bool,
}

pub fn run(opts: &Options) -> Result<()> {
    setup::ensure()?;
    let deb = package(opts.debug)?;
    if let Some(dir) = &opts.out {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let to = dir.join(deb.file_name().context("a .deb has a file name")?);
        fs::copy(&deb, &to)
            .with_context(|| format!("copying {} to {}", deb.display(), to.display()))?;
        println!("{}", to.display());
    } else {
        println!("{}", deb.display());
    }
    Ok(())
}

/// Builds the release binary (the debug one with `debug`), writes the generated pages and
/// scripts, runs cargo-deb; returns the .deb's path.
fn package(debug: bool) -> Result<PathBuf> {
    let binary = build::build(!debug)?;
    // Beside the binary, in the profile's directory: cargo-deb reads the assets'
    // `target/release/` as that directory.
    let staging = binary.with_file_name("package");
    if staging.exists() {
        fs::remove_dir_all(&staging).with_context(|| format!("emptying {}", staging.display()))?;
    }
    write_man_pages(&binary, &staging)?;
    write_completions(&binary, &staging.join("completions"))?;

    let mut deb = cmd::cargo();
    deb.args([
        "deb",
        "--package",
        "ratelimit-userspace",
        "--no-build",
        "--no-strip",
    ]);
    if debug {
        // cargo-deb 3 warns that a dev profile is not for releases: this package is not one.
        deb.args(["--profile", "dev"]);
    }
    let (status, stdout, stderr) = cmd::output(&mut deb).context("running cargo deb")?;
    if !status.success() {
        bail!("cargo deb failed ({status}): {}{}", stdout, stderr);
    }
    // cargo-deb prints the path of the package it wrote as its last line.
    let path = stdout
        .lines()
        .chain(stderr.lines())
        .map(str::trim)
        .rfind(|l| Path::new(l).extension().is_some_and(|e| e == "deb"))
        .map(PathBuf::from)
        .with_context(|| format!("cargo deb did not name a .deb: {stdout}{stderr}"))?;
    cmd::announce(&format!("package: {}", path.display()));
    Ok(path)
}

/// `ratelimit manpages DIR`, then sorted into man8/ and man5/ and gzipped (Debian policy 12.1).
fn write_man_pages(binary: &Path, staging: &Path) -> Result<()> {
    let raw = staging.join("man");
    cmd::run_step(
        "Writing the man pages (ratelimit manpages)",
        Command::new(binary).arg("manpages").arg(&raw),
    )?;
    for entry in fs::read_dir(&raw)? {
        let path = entry?.path();
        let section = path
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or_default();
        let dir = staging.join(format!("man{section}"));
        fs::create_dir_all(&dir)?;
        let to = dir.join(path.file_name().context("a page has a name")?);
        fs::rename(&path, &to)?;
        // -n: no name or time stamp in the header, so the package is reproducible.
        cmd::run_step(
            &format!("Compressing {}", to.display()),
            Command::new("gzip").args(["-9nf"]).arg(&to),
        )?;
    }
    fs::remove_dir(&raw)?;
    Ok(())
}

/// `ratelimit completions SHELL` for bash, zsh and fish, under the names each shell looks for.
fn write_completions(binary: &Path, dir: &Path) -> Result<()> {
    fs::create_dir_all(dir)?;
    for (shell, name) in [
        ("bash", "ratelimit"),
        ("zsh", "_ratelimit"),
        ("fish", "ratelimit.fish"),
    ] {
        let out = Command::new(binary)
            .args(["completions", shell])
            .output()
            .with_context(|| format!("running {} completions {shell}", binary.display()))?;
        if !out.status.success() || out.stdout.is_empty() {
            bail!(
                "`ratelimit completions {shell}` failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        fs::write(dir.join(name), out.stdout)?;
    }
    Ok(())
}
