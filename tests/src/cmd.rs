//! Running `ip` and friends: one place that turns a failed command into an error naming the exact
//! command line, its exit status and its stderr.

use std::process::Command;

use anyhow::{bail, Context, Result};

/// Runs `program args...` and returns its stdout; fails with the command line, status and stderr.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot start `{}`", command_line(program, args)))?;
    if !output.status.success() {
        bail!(
            "`{}` failed ({}): {}",
            command_line(program, args),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    String::from_utf8(output.stdout)
        .with_context(|| format!("`{}` printed non-UTF-8", command_line(program, args)))
}

/// `ip args...`.
pub(crate) fn ip(args: &[&str]) -> Result<String> {
    run("ip", args)
}

fn command_line(program: &str, args: &[&str]) -> String {
    std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ")
}
