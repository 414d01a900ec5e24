//! `cargo xtask soak`: a random-source flood larger than the bucket map for minutes (default 10)
//! against the release agent, its operator paths in use; checks that the polite source is never
//! dropped, the agent's memory stays flat and evictions are counted, and writes
//! `target/bench/soak.json` next to the benchmark's results (see BENCHMARKS.md, "Soak").
//!
//! Like `cargo xtask bench`, through [`crate::runner`]: setup, the agent and the benchmark runner
//! built in release mode, then `ratelimit-bench soak` (bench/src/soak/) does the work. Not run
//! by CI.

use std::ffi::OsString;

use anyhow::Result;

use crate::runner::{run_runner, Runner};

/// Soak the limiter: a random-source flood larger than the bucket map for 10 minutes (needs root).
///
/// The release agent attached to a veth with a per-source rule, a flood of 2^24 random sources
/// from a live-frames generator, a polite source at 200 pps; every 10 s the agent's memory and
/// CPU and its own figures through `ratelimit status/stats/top/explain` and its metrics endpoint;
/// a config reload every minute. Prints a row per sample, the verdicts, and writes
/// `target/bench/soak.json`.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Arguments for the soak, after `--`: `--minutes 1`, `--interval 10`, `--max-buckets N`,
    /// `--reload-every 60`, `--cpu N`, `--json PATH` (`cargo xtask soak -- --help` lists them).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<OsString>,
}

pub fn run(opts: &Options) -> Result<()> {
    run_runner(&Runner {
        command: "soak",
        subcommand: Some("soak"),
        json: "soak.json",
        what: "the soak",
        args: &opts.args,
        own_agent_copy: true,
    })
}
