//! The `ratelimit` CLI as the tests run it: one client command against an agent's control socket
//! (`ratelimit --socket PATH ARGS...`), its exit status and output, and the checks every test
//! makes of them (succeeded, refused, printed JSON) with the agent's log in the message.

use std::path::Path;
use std::process::{Command, ExitStatus};

use serde_json::Value;

use crate::agent::agent_binary;
use crate::agent_proc::AgentProcess;

/// What one CLI command did.
#[derive(Debug)]
pub struct CliOutput {
    /// The command line, `ratelimit ARGS...` (without the socket), for messages.
    pub command: String,
    /// Its exit status.
    pub status: ExitStatus,
    /// What it printed on stdout.
    pub stdout: String,
    /// What it printed on stderr.
    pub stderr: String,
}

impl CliOutput {
    /// Whether it exited with status 0.
    #[must_use]
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Stdout parsed as JSON.
    ///
    /// # Panics
    /// If the command failed (with its status and stderr) or printed something else than JSON.
    #[must_use]
    pub fn json(&self) -> Value {
        assert!(
            self.success(),
            "`{}` failed ({}): {}",
            self.command,
            self.status,
            self.stderr
        );
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("`{}` printed {:?}: {e}", self.command, self.stdout))
    }
}

/// Runs `ratelimit --socket SOCKET ARGS...` (the client of whatever agent listens there, or of
/// none) and returns what it did.
///
/// # Panics
/// If the binary cannot be run or prints something that is not UTF-8.
#[must_use]
pub fn cli(socket: &Path, args: &[&str]) -> CliOutput {
    let out = Command::new(agent_binary())
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .expect("running the ratelimit CLI");
    let command = format!("ratelimit {}", args.join(" "));
    let text = |bytes: Vec<u8>, what: &str| {
        String::from_utf8(bytes)
            .unwrap_or_else(|e| panic!("`{command}` printed non-UTF-8 on {what}: {e}"))
    };
    CliOutput {
        stdout: text(out.stdout, "stdout"),
        stderr: text(out.stderr, "stderr"),
        status: out.status,
        command,
    }
}

impl AgentProcess {
    /// Runs `ratelimit --socket <this agent's socket> ARGS...`; see [`cli`].
    #[must_use]
    pub fn cli(&self, args: &[&str]) -> CliOutput {
        cli(self.socket_path(), args)
    }

    /// Runs the CLI against this agent and returns its stdout.
    ///
    /// # Panics
    /// If the command fails, with its status, stderr and the agent's log.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.success(),
            "`{}` failed ({}): {}\nagent log:\n{}",
            out.command,
            out.status,
            out.stderr,
            self.log()
        );
        out.stdout
    }

    /// Runs the CLI against this agent with `--json` appended and returns the parsed output.
    ///
    /// # Panics
    /// If the command fails (with its status, stderr and the agent's log) or does not print JSON.
    pub fn cli_json(&self, args: &[&str]) -> Value {
        let args = [args, &["--json"]].concat();
        let out = self.cli_ok(&args);
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("`ratelimit {}` printed {out:?}: {e}", args.join(" ")))
    }

    /// Runs the CLI against this agent, expecting it to be refused, and returns what it did.
    ///
    /// # Panics
    /// If the command succeeds, with its stdout.
    pub fn cli_refused(&self, args: &[&str]) -> CliOutput {
        let out = self.cli(args);
        assert!(
            !out.success(),
            "`{}` succeeded but should have been refused: {}",
            out.command,
            out.stdout
        );
        out
    }
}
