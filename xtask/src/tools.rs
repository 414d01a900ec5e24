//! The packaging tools, which `cargo xtask setup` installs with the rest: cargo-deb (for `cargo
//! xtask package`), and what the packaging tests check with (systemd-analyze, man, groff, zsh,
//! fish, promtool).

use std::{fs, path::Path, process::Command};

use anyhow::{Context as _, Result};

use crate::cmd;

/// cargo-deb's major version: its `[package.metadata.deb]` keys are those of this line.
const CARGO_DEB_SERIES: &str = "3.";
/// Debian packages the packaging tests use: systemd-analyze (systemd), man (man-db), groff, the
/// shells whose completion scripts are checked.
const TEST_APT_PACKAGES: &[&str] = &["systemd", "man-db", "groff-base", "zsh", "fish"];
/// promtool is taken out of Debian's prometheus package, not installed with it: installing the
/// package would also enable and start a Prometheus server on the machine.
const PROMTOOL: &str = "/usr/local/bin/promtool";

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
