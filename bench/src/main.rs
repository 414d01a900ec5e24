//! `ratelimit-bench`: the command line of the benchmark and soak runner (the library, `src/lib.rs`,
//! says what lives where). It parses the arguments, then calls [`ratelimit_bench::run`] or, for
//! `ratelimit-bench soak`, [`ratelimit_bench::soak::run`]. Started by `cargo xtask bench` and
//! `cargo xtask soak` (xtask/src/bench.rs), which build the release agent first and pass it in
//! `RATELIMIT_BIN`; as root, it can also be run by hand: `ratelimit-bench --help`.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::Parser;
use ratelimit_bench::{soak, Options, Part};

/// Measure ratelimit against its floor, nftables and iptables (needs root).
#[derive(Debug, Parser)]
#[command(name = "ratelimit-bench", args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    mode: Option<Mode>,
    /// Runs per figure; the median is reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    /// Runs of one frame per in-kernel "repeat" measurement.
    #[arg(long, default_value_t = 1_000_000)]
    repeat: u32,
    /// New sources per in-kernel new-source run (each creates a bucket, removed afterwards).
    #[arg(long, default_value_t = 20_000)]
    new_sources: usize,
    /// Seconds per end-to-end run (and per agent sampling window).
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Seconds of traffic before each end-to-end contender's runs.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// CPU for the end-to-end generator (and so the receiving veth's NAPI poll); default: the last.
    #[arg(long)]
    cpu: Option<usize>,
    /// Only these parts (default: all): kernel, limits, cut, f1 and lru (the 1/2/3-limit cases,
    /// the A/B of the handling of cut packets, the dependent-read memory floor, and the
    /// populations with the LRU contender: parts of kernel, alone), rules, e2e, agent, cluster,
    /// learn (the learner's cost with 1M tracked sources), redis (the Redis backend at 10 to
    /// 2,000 simulated hosts).
    #[arg(long, value_delimiter = ',')]
    only: Vec<Part>,
    /// End to end: only these contenders, by their tags in results.json (such as
    /// drop_all_layered, limiter_aggregate; default: all). A group measured in turns keeps the
    /// members named.
    #[arg(long, value_delimiter = ',')]
    contenders: Vec<String>,
    /// End to end: only these traffic patterns: hot (one source), random (24 random bits a
    /// frame, every table full), known (2^19 sources, tables half full); default: all.
    #[arg(long, value_delimiter = ',')]
    patterns: Vec<String>,
    /// Tracked-source populations up to 100k only (for trying the bench out).
    #[arg(long)]
    quick: bool,
    /// Also measure the new-source memory floors on a store held in kmalloc'ed 32 KiB arrays
    /// under an array of maps (memory of the kernel's direct map, on huge pages), beside the
    /// store's own (vmalloc'ed, 4 KiB pages): what a store on huge pages would cost to read.
    #[arg(long)]
    paged_floors: bool,
    /// Also measure the new-source driver reading a key's 8 records in two stores of the
    /// bucket store's records packed in groups of 32, one of 64-byte records and one of 56: what
    /// records trimmed to 56 bytes (under 64 a source with the tags) would cost the key's read.
    #[arg(long)]
    layout_floors: bool,
    /// Also profile the limiter's program while the populations run (`perf record` of every
    /// CPU on the software clock, from Debian's linux-perf): its samples by source line, printed
    /// and written to profile.txt beside the results.
    #[arg(long)]
    profile: bool,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/results.json")]
    json: PathBuf,
}

#[derive(Debug, clap::Subcommand)]
enum Mode {
    /// Soak: a random-source flood larger than the bucket map for minutes (default 10) against
    /// the release agent, its operator paths in use; writes target/bench/soak.json.
    Soak(soak::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.mode {
        Some(Mode::Soak(args)) => {
            ratelimit_bench::start("soak");
            soak::run(args)
        }
        None => {
            ratelimit_bench::start("bench");
            let opts = Options {
                runs: cli.runs as usize,
                repeat: cli.repeat,
                new_sources: cli.new_sources,
                e2e_run: Duration::from_secs_f64(cli.seconds),
                e2e_warmup: Duration::from_secs_f64(cli.warmup),
                quick: cli.quick,
                paged_floors: cli.paged_floors,
                layout_floors: cli.layout_floors,
                profile: cli.profile.then(|| cli.json.with_file_name("profile.txt")),
                contenders: cli.contenders.clone(),
                patterns: cli.patterns.clone(),
                cpu: cli.cpu.unwrap_or_else(|| {
                    std::thread::available_parallelism().map_or(1, std::num::NonZero::get) - 1
                }),
            };
            ratelimit_bench::run(&opts, &cli.only, &cli.json)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
