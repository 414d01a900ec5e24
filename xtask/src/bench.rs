//! `cargo xtask bench`: measures the XDP program's per-packet cost and throughput against its
//! floor, nftables and iptables, and writes `target/bench/results.json` (see BENCHMARKS.md).
//!
//! Like `cargo xtask soak`, through [`crate::runner`]: setup, the agent and the benchmark runner
//! (crate `bench/`, binary `ratelimit-bench`) built in release mode, then the runner does the
//! measuring.

use std::ffi::OsString;

use anyhow::Result;

use crate::runner::{run_runner, Runner};

/// Measure the XDP program's per-packet cost and throughput (needs root; about 3 minutes).
///
/// In-kernel cost per packet through BPF_PROG_TEST_RUN against an XDP_PASS floor; packets per
/// second over a veth pair from a live-frames generator, for the limiter, a drop-all floor, an
/// XDP_PASS receiver, nftables and iptables, with one hot source and with random sources; the
/// agent's CPU and memory; rule update latency with 10,000 rules. Prints a table and writes
/// `target/bench/results.json` and a chart of the bucket store, `target/bench/store.svg`. Not a
/// test: nothing fails on a slow result.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// Arguments for the runner, after `--`: `--runs 7`, `--only kernel,e2e`, `--quick`,
    /// `--json PATH`, `--cpu N` (`cargo xtask bench -- --help` lists them).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<OsString>,
}

pub fn run(opts: &Options) -> Result<()> {
    run_runner(&Runner {
        command: "bench",
        subcommand: None,
        json: "results.json",
        what: "the benchmark",
        args: &opts.args,
        own_agent_copy: false,
    })
}
