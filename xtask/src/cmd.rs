//! What every subcommand shares: where the workspace is, and running a command as a described
//! step. Progress goes to stderr, like cargo's own, so that the stdout of `cargo xtask run -- ...`
//! is only ratelimit's (e.g. `--json` output stays parseable).

use std::{
    env,
    ffi::OsStr,
    fmt::Write as _,
    path::{Path, PathBuf},
    process::{Command, ExitStatus},
    time::Instant,
};

use anyhow::{bail, Context as _, Result};

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// The cargo target directory: `$CARGO_TARGET_DIR` if set, else `target/` in the workspace. A
/// relative one is taken from the workspace root, as the cargo that [`cargo`] starts there does.
pub fn target_dir() -> PathBuf {
    let root = workspace_root();
    env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), |dir| root.join(dir))
}

/// `cargo` for the user-space crates, in the workspace. Under rustup this is the toolchain that
/// runs this xtask: rustup exports `RUSTUP_TOOLCHAIN` to it, and the `cargo` proxy follows that.
pub fn cargo() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(workspace_root());
    cmd
}

/// `rustup run nightly cargo` for the eBPF crate, in the workspace, with the variables the stable
/// cargo that runs this xtask exported removed (see [`ebpf_build::nightly_cargo_in`]).
pub fn nightly_cargo() -> Command {
    ebpf_build::nightly_cargo_in(&workspace_root())
}

/// How the XDP program is built (flags, the nightly cargo), shared with
/// ratelimit-userspace/build.rs and the tests.
pub mod ebpf_build {
    include!("../../ratelimit-ebpf/nightly_build.rs");
}

/// Prints a one-line description of a step about to run.
pub fn announce(description: &str) {
    eprintln!("==> {description}");
}

/// Runs `cmd` as a step: prints `description` and the command line, lets the command's output
/// through untouched, then reports how it went. Fails if the command does not succeed.
pub fn run_step(description: &str, cmd: &mut Command) -> Result<()> {
    let status = run_step_status(description, cmd)?;
    if !status.success() {
        bail!("{description}: `{}` failed ({status})", display(cmd));
    }
    Ok(())
}

/// Like [`run_step`], but hands back the exit status instead of failing on a non-zero one.
pub fn run_step_status(description: &str, cmd: &mut Command) -> Result<ExitStatus> {
    announce(description);
    eprintln!("    $ {}", display(cmd));
    let start = Instant::now();
    let status = cmd
        .status()
        .with_context(|| format!("{description}: could not start `{}`", display(cmd)))?;
    let secs = start.elapsed().as_secs_f64();
    if status.success() {
        eprintln!("==> ok: {description} ({secs:.1} s)");
    } else {
        eprintln!("==> FAILED: {description} ({status}, {secs:.1} s)");
    }
    Ok(status)
}

/// Runs `cmd` quietly and returns its stdout, or `None` if it could not be started (not installed).
/// A command that starts but fails returns its stdout anyway, with the status, for the caller to judge.
pub fn output(cmd: &mut Command) -> Option<(ExitStatus, String, String)> {
    let out = cmd.output().ok()?;
    Some((
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The command line as one could paste it into a shell, with the variables it sets in front.
pub fn display(cmd: &Command) -> String {
    let mut line = String::new();
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            let _ = write!(line, "{}={} ", key.to_string_lossy(), quote(value));
        }
    }
    line.push_str(&quote(cmd.get_program()));
    for arg in cmd.get_args() {
        line.push(' ');
        line.push_str(&quote(arg));
    }
    line
}

/// Quotes a word for a POSIX shell when it needs it.
fn quote(word: &OsStr) -> String {
    let word = word.to_string_lossy();
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+^@%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.into_owned()
    } else if word.chars().all(|c| !c.is_control()) {
        format!("'{}'", word.replace('\'', r"'\''"))
    } else {
        // Control characters (CARGO_ENCODED_RUSTFLAGS's \x1f separators): bash's $'...' form.
        let mut quoted = String::from("$'");
        for c in word.chars() {
            match c {
                '\'' | '\\' => {
                    quoted.push('\\');
                    quoted.push(c);
                }
                c if c.is_control() => {
                    let _ = write!(quoted, "\\x{:02x}", u32::from(c));
                }
                c => quoted.push(c),
            }
        }
        quoted.push('\'');
        quoted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_quotes_what_a_shell_would_split() {
        let mut cmd = Command::new("cargo");
        cmd.env("LLVM_PREFIX", "/usr/lib/llvm-22")
            .env("FLAGS", "a\x1fb")
            .args(["install", "--version", "^0.13", "it's here", ""]);
        assert_eq!(
            display(&cmd),
            r"FLAGS=$'a\x1fb' LLVM_PREFIX=/usr/lib/llvm-22 cargo install --version ^0.13 'it'\''s here' ''"
        );
    }
}
