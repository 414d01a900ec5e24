//! `cargo xtask setup`: makes a fresh Debian 12 machine able to build and test ratelimit, installing
//! only what is missing (see docs/toolchain.md for why each piece is needed). When everything is
//! present it prints one line and takes well under a second: no network, no apt, no cargo.

use std::{
    env,
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use crate::cmd;

/// Install the toolchain and system packages the XDP program and the tests need.
#[derive(Debug, clap::Args)]
pub struct Options {}

/// A Debian package setup installs, and what for.
struct AptPackage {
    name: &'static str,
    /// Needed to build bpf-linker (and so the XDP program), not only to test or benchmark.
    to_build: bool,
}

const APT_PACKAGES: &[AptPackage] = &[
    // bpf-linker links against LLVM 22, rustc nightly's LLVM; these are what its build links.
    AptPackage {
        name: "llvm-22-dev",
        to_build: true,
    },
    AptPackage {
        name: "libpolly-22-dev",
        to_build: true,
    },
    AptPackage {
        name: "libzstd-dev",
        to_build: true,
    },
    AptPackage {
        name: "zlib1g-dev",
        to_build: true,
    },
    // `ip netns` and veth pairs, for the integration tests and the demo.
    AptPackage {
        name: "iproute2",
        to_build: false,
    },
    // The benchmarks compare against them.
    AptPackage {
        name: "nftables",
        to_build: false,
    },
    AptPackage {
        name: "iptables",
        to_build: false,
    },
    // The tests of `[cluster] backend = "redis"` start their own redis-server (and use
    // redis-cli) in their namespaces; the package's own service is disabled after the install.
    AptPackage {
        name: "redis-server",
        to_build: false,
    },
];

/// bpf-linker's 0.13 line is the one that builds against LLVM 22 (feature `llvm-22`).
const BPF_LINKER_SERIES: &str = "0.13.";
/// Where Debian's llvm-22-dev lives; bpf-linker's build script reads `LLVM_PREFIX`.
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
const BPFFS: &str = "/sys/fs/bpf";

pub fn run(_opts: &Options) -> Result<()> {
    ensure()
}

/// Checks every piece and installs the missing ones. Every other subcommand calls this first.
pub fn ensure() -> Result<()> {
    let cargo_bin = cargo_bin_dir();
    let path_note = put_on_path(&cargo_bin);
    let root = is_root()?;
    // cargo-deb and the packaging tests' tools (systemd-analyze, man, zsh, fish, promtool).
    crate::tools::ensure_tools(root)?;
    let missing: Vec<&AptPackage> = missing_apt_packages(APT_PACKAGES)?;
    let rust_src = nightly_has_rust_src()?;
    let mut linker = bpf_linker();
    let bpffs = bpffs_mounted()?;

    if let Some(note) = path_note {
        eprintln!("==> setup: {note}");
    }
    if missing.is_empty() && rust_src && bpffs {
        if let Linker::Found(version) = &linker {
            eprintln!(
                "==> setup: all present (apt packages, nightly rust-src, {version}, bpffs at {BPFFS})"
            );
            return Ok(());
        }
    }

    if !root {
        let mut commands = Vec::new();
        if !missing.is_empty() {
            commands.push(apt_command_line(&missing));
        }
        if !bpffs {
            commands.push(format!("mount -t bpf -o mode=0700 bpf {BPFFS}"));
        }
        if !commands.is_empty() {
            eprintln!("==> setup: not running as root, so not doing these; run them as root:");
            for command in &commands {
                eprintln!("    {command}");
            }
        }
        let build_deps_missing = missing.iter().any(|p| p.to_build);
        if build_deps_missing && !matches!(linker, Linker::Found(_)) {
            bail!("bpf-linker needs building, which needs the packages above: run those commands as root, then this again");
        }
    } else if !missing.is_empty() {
        install_apt_packages(&missing)?;
        // A bpf-linker that failed to start for want of libLLVM may work now.
        linker = bpf_linker();
    }

    if !rust_src {
        cmd::run_step(
            "Adding rust-src to the nightly toolchain (`-Z build-std=core` compiles core from it)",
            Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]),
        )?;
    }

    if !matches!(linker, Linker::Found(_)) {
        install_bpf_linker(&linker, &cargo_bin)?;
    }

    if !bpffs && root {
        cmd::run_step(
            &format!("Mounting bpffs at {BPFFS} (the agent pins its maps and XDP link there)"),
            Command::new("mount").args(["-t", "bpf", "-o", "mode=0700", "bpf", BPFFS]),
        )?;
    }
    eprintln!("==> setup: done");
    Ok(())
}

/// `$CARGO_HOME/bin`, where rustup and `cargo install` put binaries (bpf-linker among them).
fn cargo_bin_dir() -> PathBuf {
    env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"))
        .join("bin")
}

/// Puts `dir` at the front of this process's `PATH` unless it is on it already, so that the
/// builds this xtask starts find a bpf-linker installed there. Returns a note saying so, if it did.
fn put_on_path(dir: &Path) -> Option<String> {
    let path = env::var_os("PATH").unwrap_or_default();
    if env::split_paths(&path).any(|entry| entry == dir) {
        return None;
    }
    let joined: OsString =
        env::join_paths(std::iter::once(dir.to_path_buf()).chain(env::split_paths(&path))).ok()?;
    // Single-threaded at this point: nothing else reads the environment concurrently.
    env::set_var("PATH", joined);
    Some(format!(
        "{} was not on PATH; added it for this run (add it to your shell's PATH too)",
        dir.display()
    ))
}

/// Whether this process runs as root (effective uid 0), from `/proc/self/status`.
pub fn is_root() -> Result<bool> {
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    effective_uid(&status)
        .map(|uid| uid == 0)
        .context("no `Uid:` line in /proc/self/status")
}

/// The effective uid from `/proc/self/status`'s `Uid:` line (real, effective, saved, filesystem uids).
fn effective_uid(status: &str) -> Option<u32> {
    let line = status.lines().find_map(|line| line.strip_prefix("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The packages of `wanted` that dpkg does not have installed, asked in one `dpkg-query` call.
fn missing_apt_packages(wanted: &'static [AptPackage]) -> Result<Vec<&'static AptPackage>> {
    let mut query = Command::new("dpkg-query");
    query
        .args(["-W", "-f=${Package}\t${Status}\n"])
        .args(wanted.iter().map(|p| p.name));
    // dpkg-query exits 1 when some package is unknown to it, and still lists the others.
    let Some((_, stdout, _)) = cmd::output(&mut query) else {
        bail!("`dpkg-query` not found: `cargo xtask setup` supports Debian 12; install the equivalents of {} yourself",
            wanted.iter().map(|p| p.name).collect::<Vec<_>>().join(" "));
    };
    let installed = installed_packages(&stdout);
    Ok(wanted
        .iter()
        .filter(|p| !installed.contains(&p.name))
        .collect())
}

/// Package names that `dpkg-query -W -f='${Package}\t${Status}\n'` reports as installed: a status
/// of `install ok installed` (or `hold ok installed`), not e.g. `deinstall ok config-files`.
fn installed_packages(dpkg_output: &str) -> Vec<&str> {
    dpkg_output
        .lines()
        .filter_map(|line| {
            let (name, status) = line.split_once('\t')?;
            let mut words = status.split_whitespace();
            let want = words.next()?;
            let state = words.nth(1)?;
            (matches!(want, "install" | "hold") && state == "installed").then_some(name)
        })
        .collect()
}

fn apt_command_line(packages: &[&AptPackage]) -> String {
    let names: Vec<&str> = packages.iter().map(|p| p.name).collect();
    format!(
        "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y {}",
        names.join(" ")
    )
}

fn install_apt_packages(packages: &[&AptPackage]) -> Result<()> {
    let names: Vec<&str> = packages.iter().map(|p| p.name).collect();
    cmd::run_step(
        "Updating apt's package lists (some packages are missing)",
        Command::new("apt-get")
            .arg("update")
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    cmd::run_step(
        &format!("Installing missing apt packages: {}", names.join(" ")),
        Command::new("apt-get")
            .args(["install", "-y"])
            .args(&names)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    if names.contains(&"redis-server") {
        // The tests run their own servers; the system's would hold port 6379 on the host. Where
        // systemd is not init this fails, and nothing was started: nothing to do.
        let _ = cmd::output(Command::new("systemctl").args(["disable", "--now", "redis-server"]));
    }
    Ok(())
}

/// Whether nightly has rust-src; fails, saying what to do, if there is no nightly toolchain.
fn nightly_has_rust_src() -> Result<bool> {
    let mut list = Command::new("rustup");
    list.args(["component", "list", "--toolchain", "nightly", "--installed"])
        // A missing toolchain is an error to report, not something to download behind the user's back.
        .env("RUSTUP_AUTO_INSTALL", "0");
    let Some((status, stdout, stderr)) = cmd::output(&mut list) else {
        bail!("`rustup` not found: install rustup with a stable and a `nightly` toolchain");
    };
    if !status.success() {
        bail!(
            "the rustup toolchain `nightly` is not usable; the XDP program builds with it \
             (`-Z build-std=core`). Install it with `rustup toolchain install nightly` (use the plain \
             `nightly` channel, not a dated one). rustup said: {}",
            stderr.trim()
        );
    }
    Ok(has_rust_src(&stdout))
}

/// Whether `rustup component list --installed` output lists rust-src (it has no target suffix).
fn has_rust_src(component_list: &str) -> bool {
    component_list
        .lines()
        .any(|line| line.trim() == "rust-src" || line.trim().starts_with("rust-src-"))
}

/// What `bpf-linker --version` says.
#[derive(Debug, PartialEq, Eq)]
enum Linker {
    /// A 0.13.x: the version line, e.g. `bpf-linker 0.13.0`.
    Found(String),
    /// Not on PATH nor in `$CARGO_HOME/bin`.
    Missing,
    /// Present but another version, or it does not run (e.g. its libLLVM is gone): what it said.
    Unusable(String),
}

/// Asks the bpf-linker on PATH (which [`put_on_path`] made include `$CARGO_HOME/bin`) its version.
fn bpf_linker() -> Linker {
    match cmd::output(Command::new("bpf-linker").arg("--version")) {
        Some((status, stdout, stderr)) => linker_from_version(status.success(), &stdout, &stderr),
        None => Linker::Missing,
    }
}

fn linker_from_version(ran: bool, stdout: &str, stderr: &str) -> Linker {
    let line = stdout.lines().next().unwrap_or_default().trim();
    if !ran {
        return Linker::Unusable(format!("`bpf-linker --version` failed: {}", stderr.trim()));
    }
    match line.split_whitespace().nth(1) {
        Some(version) if version.starts_with(BPF_LINKER_SERIES) => Linker::Found(line.to_owned()),
        _ => Linker::Unusable(format!("`bpf-linker --version` says {line:?}")),
    }
}

fn install_bpf_linker(found: &Linker, cargo_bin: &Path) -> Result<()> {
    let why = match found {
        Linker::Missing => "bpf-linker is missing".to_owned(),
        Linker::Unusable(what) => format!("{what}, want {BPF_LINKER_SERIES}x"),
        Linker::Found(_) => unreachable!("only called when bpf-linker needs installing"),
    };
    let mut install = cmd::cargo();
    install
        .args(["install", "bpf-linker", "--version", "^0.13"])
        // Its default feature is llvm-23; nightly's LLVM is 22.
        .args(["--no-default-features", "--features", "llvm-22"])
        .env("LLVM_PREFIX", LLVM_PREFIX);
    cmd::run_step(
        &format!("Installing bpf-linker 0.13 against LLVM 22 into {} ({why}); it compiles for about 3 minutes", cargo_bin.display()),
        &mut install,
    )?;
    match bpf_linker() {
        Linker::Found(version) => {
            eprintln!("==> setup: {version} installed");
            Ok(())
        }
        Linker::Missing => bail!(
            "installed bpf-linker into {}, but `bpf-linker` is still not found on PATH",
            cargo_bin.display()
        ),
        Linker::Unusable(what) => bail!(
            "installed bpf-linker into {}, but {what}: is another bpf-linker earlier on PATH?",
            cargo_bin.display()
        ),
    }
}

/// Whether bpffs is mounted at [`BPFFS`].
fn bpffs_mounted() -> Result<bool> {
    let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    Ok(has_bpffs(&mounts))
}

fn has_bpffs(mounts: &str) -> bool {
    mounts.lines().any(|line| {
        let mut fields = line.split_whitespace();
        let (_source, target, fstype) = (fields.next(), fields.next(), fields.next());
        target == Some(BPFFS) && fstype == Some("bpf")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dpkg_status_installed_only() {
        let out = "llvm-22-dev\tinstall ok installed\n\
                   iptables\tdeinstall ok config-files\n\
                   nftables\thold ok installed\n\
                   iproute2\tinstall ok unpacked\n";
        assert_eq!(installed_packages(out), ["llvm-22-dev", "nftables"]);
        assert!(installed_packages("").is_empty());
    }

    #[test]
    fn effective_uid_is_the_second_field() {
        let status = "Name:\txtask\nUid:\t1000\t0\t0\t0\nGid:\t0\t0\t0\t0\n";
        assert_eq!(effective_uid(status), Some(0));
        assert_eq!(effective_uid("Uid:\t0\t1000\t1000\t1000\n"), Some(1000));
        assert_eq!(effective_uid("Name:\tx\n"), None);
    }

    #[test]
    fn rust_src_in_component_list() {
        let with = "cargo-x86_64-unknown-linux-gnu\nrust-src\nrustc-x86_64-unknown-linux-gnu\n";
        assert!(has_rust_src(with));
        assert!(!has_rust_src(
            "cargo-x86_64-unknown-linux-gnu\nrust-std-x86_64-unknown-linux-gnu\n"
        ));
    }

    #[test]
    fn bpf_linker_versions() {
        assert_eq!(
            linker_from_version(true, "bpf-linker 0.13.0\n", ""),
            Linker::Found("bpf-linker 0.13.0".into())
        );
        assert!(matches!(
            linker_from_version(true, "bpf-linker 0.9.15\n", ""),
            Linker::Unusable(_)
        ));
        assert!(matches!(
            linker_from_version(true, "bpf-linker 0.130.0\n", ""),
            Linker::Unusable(_)
        ));
        assert!(matches!(
            linker_from_version(
                false,
                "",
                "error while loading shared libraries: libLLVM.so.22.1"
            ),
            Linker::Unusable(_)
        ));
    }

    #[test]
    fn bpffs_in_mounts() {
        let without = "sysfs /sys sysfs rw 0 0\nproc /proc proc rw 0 0\n";
        assert!(!has_bpffs(without));
        assert!(has_bpffs(&format!(
            "{without}bpf /sys/fs/bpf bpf rw,nosuid 0 0\n"
        )));
        // bpffs mounted elsewhere does not count; nor does another fs at /sys/fs/bpf.
        assert!(!has_bpffs(
            "bpf /mnt/bpf bpf rw 0 0\ntmpfs /sys/fs/bpf tmpfs rw 0 0\n"
        ));
    }
}
