//! `cargo xtask package`: the Debian package (`target/debian/ratelimit_VERSION_ARCH.deb`), built by
//! cargo-deb from `[package.metadata.deb]` in ratelimit-userspace/Cargo.toml: the release binary,
//! the conffile, the systemd unit and maintainer scripts (packaging/debian/), and the man pages and
//! shell completions the binary writes itself (into target/release/package/ first).
//!
//! Also [`ensure_tools`], which `cargo xtask setup` calls: cargo-deb, and what the packaging tests
//! check with (systemd-analyze, man, zsh, fish, promtool).

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
}

/// cargo-deb's major version: its `[package.metadata.deb]` keys are those of this line.
const CARGO_DEB_SERIES: &str = "3.";
/// Debian packages the packaging tests use: systemd-analyze (systemd), man (man-db), groff, the
/// shells whose completion scripts are checked.
const TEST_APT_PACKAGES: &[&str] = &["systemd", "man-db", "groff-base", "zsh", "fish"];
/// promtool is taken out of Debian's prometheus package, not installed with it: installing the
/// package would also enable and start a Prometheus server on the machine.
const PROMTOOL: &str = "/usr/local/bin/promtool";

pub fn run(opts: &Options) -> Result<()> {
    setup::ensure()?;
    let deb = package()?;
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

/// Builds the release binary, writes the generated pages and scripts, runs cargo-deb; returns the
/// .deb's path.
fn package() -> Result<PathBuf> {
    let binary = build::build(true)?;
    let staging = cmd::target_dir().join("release").join("package");
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

/// Installs what packaging and its tests need, if missing: the apt packages above, promtool and
/// cargo-deb. Without root, says what is missing and goes on (the tests that need a tool say so).
pub fn ensure_tools(root: bool) -> Result<()> {
    let missing: Vec<&str> = TEST_APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    let promtool = Path::new(PROMTOOL).exists() || on_path("promtool");
    let cargo_deb = cargo_deb_ok();
    if missing.is_empty() && promtool && cargo_deb {
        return Ok(());
    }
    if !root {
        if !missing.is_empty() || !promtool {
            eprintln!(
                "==> setup: not root, so not installing {}{}: the packaging tests need them",
                missing.join(" "),
                if promtool { "" } else { " promtool" }
            );
        }
    } else {
        if !missing.is_empty() {
            cmd::run_step(
                "Updating apt's package lists (packaging test tools are missing)",
                Command::new("apt-get")
                    .arg("update")
                    .env("DEBIAN_FRONTEND", "noninteractive"),
            )?;
            cmd::run_step(
                &format!(
                    "Installing {} (the packaging tests check with them)",
                    missing.join(" ")
                ),
                Command::new("apt-get")
                    .args(["install", "-y", "--no-install-recommends"])
                    .args(&missing)
                    .env("DEBIAN_FRONTEND", "noninteractive"),
            )?;
        }
        if !promtool {
            install_promtool()?;
        }
    }
    if !cargo_deb {
        cmd::run_step(
            "Installing cargo-deb 3 (cargo xtask package builds the .deb with it; about 2 minutes)",
            cmd::cargo().args(["install", "cargo-deb", "--locked", "--version", "^3"]),
        )?;
    }
    Ok(())
}

fn dpkg_installed(package: &str) -> bool {
    cmd::output(Command::new("dpkg-query").args(["-W", "-f=${Status}", package]))
        .is_some_and(|(_, out, _)| out.trim_end().ends_with(" installed"))
}

fn on_path(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn cargo_deb_ok() -> bool {
    cmd::output(cmd::cargo().args(["deb", "--version"])).is_some_and(|(status, out, _)| {
        status.success()
            && out
                .split_whitespace()
                .any(|w| w.starts_with(CARGO_DEB_SERIES))
    })
}

/// `apt-get download prometheus` and copy its `usr/bin/promtool` to [`PROMTOOL`].
fn install_promtool() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("xtask-promtool-{}", std::process::id()));
    fs::create_dir_all(&dir)?;
    let result =
        (|| {
            cmd::run_step(
            "Downloading Debian's prometheus package for its promtool (not installing the server)",
            Command::new("apt-get").arg("download").arg("prometheus").current_dir(&dir),
        )?;
            let deb = fs::read_dir(&dir)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .find(|p| p.extension().is_some_and(|e| e == "deb"))
                .context("apt-get download left no .deb")?;
            let tree = dir.join("tree");
            cmd::run_step(
                "Unpacking it into a temporary directory",
                Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tree),
            )?;
            fs::copy(tree.join("usr/bin/promtool"), PROMTOOL)
                .with_context(|| format!("copying promtool to {PROMTOOL}"))?;
            eprintln!("==> setup: installed {PROMTOOL} (from {})", deb.display());
            anyhow::Ok(())
        })();
    let _ = fs::remove_dir_all(&dir);
    result
}
