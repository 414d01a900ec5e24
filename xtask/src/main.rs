//! `cargo xtask`: the one entry point for building, running, testing and benchmarking ratelimit,
//! and for installing the toolchain the XDP program needs. Every subcommand runs `setup` first, so a
//! fresh Debian 12 machine needs nothing but rustup (stable and nightly) before `cargo xtask test`.
//!
//! It only orchestrates: each subcommand is a module with an `Options` struct and a `run` that
//! checks, builds and starts cargo or a program, and the work happens there. [`setup`] installs the
//! toolchain; [`build`] builds `ratelimit` (ratelimit-userspace, whose build script compiles and
//! embeds the XDP program), which [`run`], [`test`], [`demo`], [`bench`] and [`soak`] build first;
//! [`bench`] and [`soak`] start the benchmark runner the same way, through [`runner`]; [`lint`]
//! and [`mutants`] run cargo's checkers; [`cmd`] is what they all share (the workspace's paths, a
//! command run as a described step). The programs it starts live in crates of their own: the
//! demo driver in `demo/` (`ratelimit-demo`), the benchmark and soak runner in `bench/`
//! (`ratelimit-bench`). xtask depends on none of the project's crates, so that it compiles before
//! `setup` has installed what they need.

mod bench;
mod build;
mod cmd;
mod demo;
mod lanes;
mod lint;
mod mutants;
mod package;
mod run;
mod runner;
mod setup;
mod soak;
mod test;
mod tools;

use std::process::ExitCode;

use clap::Parser;

/// Build, run, test and benchmark ratelimit; set up the eBPF toolchain.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Install what building and testing need, only what is missing (as root).
    ///
    /// apt packages (LLVM 22 for bpf-linker, iproute2, nftables, iptables), rust-src for the nightly
    /// toolchain, bpf-linker 0.13 built against LLVM 22, and bpffs mounted at /sys/fs/bpf.
    Setup(setup::Options),
    /// Build the `ratelimit` binary with the XDP program inside it.
    Build(build::Options),
    /// Build, then run `ratelimit` with the given arguments, e.g. `cargo xtask run -- agent -c FILE`.
    Run(run::Options),
    /// Run the unit and integration tests (as root: they create network namespaces).
    Test(test::Options),
    /// Check formatting, and run clippy on the user-space crates and on the eBPF crate.
    Lint(lint::Options),
    /// Show the rate limiter at work in network namespaces.
    Demo(demo::Options),
    /// Measure the XDP program's per-packet cost and throughput.
    Bench(bench::Options),
    /// Flood the limiter with random sources for 10 minutes; check memory, evictions, polite source.
    Soak(soak::Options),
    /// Mutation testing (cargo-mutants) of the modules that need no root; not run by CI.
    Mutants(mutants::Options),
    /// Build the Debian package: binary, systemd unit, conffile, man pages, completions.
    Package(package::Options),
}

fn main() -> ExitCode {
    let Cli { command } = Cli::parse();
    let result = match command {
        Command::Setup(opts) => setup::run(&opts),
        Command::Build(opts) => build::run(&opts),
        Command::Run(opts) => run::run(&opts),
        Command::Test(opts) => test::run(&opts),
        Command::Lint(opts) => lint::run(&opts),
        Command::Demo(opts) => demo::run(&opts),
        Command::Bench(opts) => bench::run(&opts),
        Command::Soak(opts) => soak::run(&opts),
        Command::Mutants(opts) => mutants::run(&opts),
        Command::Package(opts) => package::run(&opts),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // The context chain on one line; no backtrace (RUST_BACKTRACE is often set on these
            // machines, and a failed step's own output already says where it went wrong).
            eprintln!("Error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
