//! `cargo xtask bench`: measures the XDP program's per-packet cost and throughput.

use anyhow::{bail, Result};

use crate::{build, setup};

/// Measure the XDP program's per-packet cost and throughput (needs root).
#[derive(Debug, clap::Args)]
pub struct Options {}

pub fn run(_opts: &Options) -> Result<()> {
    setup::ensure()?;
    let _binary = build::build(true)?;
    // TODO(lead): the benchmarks: BPF_PROG_TEST_RUN per-packet cost (hot key, new keys, spoofed
    // flood), live-frames throughput over a veth pair, and nftables/iptables for comparison.
    bail!("`cargo xtask bench` is not implemented yet")
}
