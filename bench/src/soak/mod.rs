//! `ratelimit-bench soak` (run by `cargo xtask soak`): a random-source flood larger than the
//! bucket map, for minutes, against the real release agent, with the operator paths in use.
//!
//! The agent is attached (native XDP) to the receiving veth of a fresh [`Testbed`] with one rule,
//! 1000 packets/s and a burst of 2000 per source for `0.0.0.0/0`, its control socket and metrics
//! endpoint on. For the whole soak:
//! - the random-source generator (24 random bits: 2^24 sources) floods the veth from one CPU, in
//!   chunks of two seconds so that Ctrl-C is honoured;
//! - a polite source sends 200 packets/s through the stack to a receiver in the agent's namespace;
//! - every sample (10 s): the agent's resident memory (VmRSS, VmHWM) and CPU time from /proc, and
//!   its own figures through its operator paths, as a production operator would read them:
//!   `ratelimit status --json`, `stats --json`, `top --json`, `explain <polite source> --json`
//!   and a `GET /metrics` scrape; the generator's rate and the veth's `rx_packets`;
//! - every minute a reload of an equivalent config, in turn by rewriting the config file (the
//!   agent's file watcher), by SIGHUP and by `ratelimit rules reload`.
//!
//! Evictions: the XDP program counts them itself, split by what the evicted bucket held
//! (`evicted_full`: it had refilled, nothing lost; `evicted_lost`: it was in debt), read through
//! `ratelimit stats --json` (global counters) and the metrics, not from the maps. No rule is
//! removed during the soak, so at rest they must add up to buckets created (`new_buckets`) minus
//! the growth of the tracked count: the soak checks that too.
//!
//! Memory: VmRSS at rest (read every second between the samples' calls) moves in a band, as the
//! allocator keeps or trims the buffers of the map walks behind the operator paths. From the
//! first minute on, and once the map is full, the band must not rise: its floor and its ceiling
//! in the second half within max(2 MiB, 5%) of the first half's, and the least-squares trend of
//! the per-minute floor within the same over the window.
//!
//! Prints a row per sample, then a table and the verdicts, and writes JSON (`--json`).
//!
//! This file holds the run and what its steps share (the arguments, a [`Sample`], the final
//! reads); `ops.rs` the agent's operator paths (CLI calls, the metrics scrape, a reload, /proc),
//! `sample.rs` a sample's JSON and table row, `judge.rs` the figures and the verdicts.

mod judge;
mod ops;
mod sample;
#[cfg(test)]
mod tests;

use std::{
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use ratelimit_testbed::{bind_udp, send_udp, AgentProcess, Receiver};
use serde_json::{json, Value};

use self::{
    judge::{evictions, judge},
    ops::{counter, cpu_time_ns, Ops, Reload},
};
use crate::{
    agent::{agent_pid, rss_kib, vm_field},
    e2e::{Testbed, BURST, POLITE, POLITE_PPS, RATE, SERVER},
    generator::pin_to_cpu,
    refs::Refs,
};

/// Bits of the source address the random generator draws (see [`crate::generator`]).
const RANDOM_BITS: u32 = 24;
/// Length of one generator call chain and of one polite sending round: the longest a Ctrl-C or
/// the end of the soak waits for them.
const CHUNK: Duration = Duration::from_secs(2);
/// How long one CLI call or scrape may take before it counts as failed (and is killed).
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Where the agent serves metrics, inside the receiving namespace (which is the soak's own).
const METRICS: &str = "127.0.0.1:9477";
/// Memory is judged on the samples from this much into the soak on (start-up and first
/// allocations are over by then; shorter runs use their second half), and not before the bucket
/// map is full: until then the agent's answers grow with the map.
const SETTLE: Duration = Duration::from_secs(60);
/// The soak's default bucket store capacity, as in the soaks before the store was an array (so
/// their figures compare). A new source's first packet passes without a bucket, but the ones
/// whose line of first-packet slots is full make theirs (131,072 slots, as many as the
/// default's: `ratelimit_common::FIRST_MIN_LINES`; 1 frame in 42.5 at 0.8 Mpps): the store
/// fills and then evicts for the rest of the soak (`--max-buckets 1048576` for the default
/// size, which takes longer to fill).
const SOAK_MAX_BUCKETS: u32 = 1 << 17;
/// The bucket store counts as full from this share of its capacity on: a new source takes a free
/// record only in its own two sets, so the last free records fill slowly.
const FULL_SHARE: f64 = 0.99;
/// Most `evicted_lost` a flood of one-packet sources may cause, as a share of all evictions: such
/// a source's bucket has refilled a millisecond (its one packet's cost) after it was created, long
/// before a new source comes to its set, so nearly every eviction is of a full bucket.
const LOST_SHARE: f64 = 0.01;

/// Flood the limiter with random sources for minutes, operator paths in use (needs root).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Length of the soak in minutes (traffic time; start-up and the final reads come on top).
    #[arg(long, default_value_t = 10.0)]
    minutes: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 10.0)]
    interval: f64,
    /// Seconds between reloads of the (unchanged) config: file rewrite, SIGHUP, `rules reload`.
    #[arg(long, default_value_t = 60.0)]
    reload_every: f64,
    /// The agent's `max_buckets` (bucket map capacity; the agent's default is 1048576, which a
    /// 10-minute flood does not fill here, see docs/journal.md, "Soak").
    #[arg(long, default_value_t = SOAK_MAX_BUCKETS)]
    max_buckets: u32,
    /// CPU for the generator and the polite sender (and so the receiving NAPI poll); default: the
    /// last.
    #[arg(long)]
    cpu: Option<usize>,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/soak.json")]
    json: PathBuf,
}

const RULE: &str = "per-source";

/// One sample of the soak.
#[derive(Clone, Debug, Default)]
struct Sample {
    /// Seconds since the flood started.
    t: f64,
    /// VmRSS at the sample, before its calls.
    rss_kib: u64,
    /// Lowest and highest VmRSS of the once-a-second readings between the previous sample's
    /// calls and this sample (the agent at rest).
    rss_min_kib: u64,
    rss_max_kib: u64,
    hwm_kib: u64,
    /// Agent CPU over the interval since the previous sample, percent of one core.
    cpu_pct: f64,
    /// Generator frames per second over the interval, millions.
    gen_mpps: f64,
    /// Receiving veth's `rx_packets` per second over the interval, millions.
    rx_mpps: f64,
    /// Receiving veth's `rx_dropped` over the interval (its ring was full).
    rx_ring_drops: u64,
    /// From `stats --json`.
    tracked: u64,
    capacity: u64,
    new_buckets: u64,
    bucket_errors: u64,
    passed: u64,
    dropped_rate: u64,
    no_bucket: u64,
    /// Evictions counted by the program since the soak started (`evicted_full + evicted_lost`).
    evicted: i64,
    /// `evicted_full` and `evicted_lost` (global counters, since the agent started).
    evicted_full: u64,
    evicted_lost: u64,
    /// From the metrics endpoint: `ratelimit_bucket_evictions_total` by state (full, lost).
    metrics_evicted_full: u64,
    metrics_evicted_lost: u64,
    /// From `status --json`.
    status_tracked: u64,
    reloads_ok: u64,
    reloads_failed: u64,
    /// From `top --json`: buckets that saw packets in its interval.
    top_active: u64,
    /// From the metrics endpoint.
    metrics_new_buckets: u64,
    metrics_tracked: u64,
    /// From `explain <polite> --json`: its bucket's counts and age.
    polite_bucket_passed: Option<u64>,
    polite_bucket_dropped: Option<u64>,
    polite_bucket_age_secs: Option<f64>,
    /// The polite source so far: sent (completed rounds) and received.
    polite_sent: u64,
    polite_received: u64,
    /// Milliseconds each operator call took.
    ms_status: f64,
    ms_stats: f64,
    ms_top: f64,
    ms_explain: f64,
    ms_metrics: f64,
    /// Calls that failed in this sample.
    errors: Vec<String>,
}

/// Totals the traffic threads keep.
#[derive(Default)]
struct Traffic {
    frames: AtomicU64,
    polite_sent: AtomicU64,
    polite_skipped: AtomicU64,
    polite_errors: AtomicU64,
}

/// The soak: the agent started on a fresh testbed, the flood and the polite source run for
/// `--minutes` while [`Soak::sample_loop`] samples and reloads, then the final reads and the
/// verdicts.
pub fn run(args: &Args) -> Result<()> {
    let cpu = args.checked_cpu()?;
    let mut machine = crate::session::machine();

    crate::session::announce("loading the random-source generator; creating namespaces");
    let refs = Refs::load()?;
    let bed = Testbed::new()?;
    let mut agent = start_agent(&bed, args)?;
    let pid = agent_pid(agent.config_path())?;
    let ops = Ops {
        socket: agent.socket_path().to_path_buf(),
        bed: &bed,
    };
    let (before, _) = ops.cli(&["stats", "--json"])?;
    let receiver = Receiver::bind(bed.rx(), SocketAddr::new(SERVER.into(), 0))?;
    let soak = Soak {
        refs: &refs,
        bed: &bed,
        ops: &ops,
        receiver: &receiver,
        traffic: Traffic::default(),
        stop: AtomicBool::new(false),
        pid,
        cpu,
        duration: Duration::from_secs_f64(args.minutes * 60.0),
        interval: Duration::from_secs_f64(args.interval),
        reload_every: Duration::from_secs_f64(args.reload_every),
        evicted0: (
            counter(&before["global"]["evicted_full"]),
            counter(&before["global"]["evicted_lost"]),
        ),
    };
    soak.announce(args.minutes);
    println!("{}", Sample::header());
    let mut samples: Vec<Sample> = Vec::new();
    let mut reloads: Vec<Value> = Vec::new();
    let started = Instant::now();
    soak.drive(&mut agent, started, &mut samples, &mut reloads)?;
    let traffic_secs = started.elapsed().as_secs_f64();
    let Soak {
        traffic, duration, ..
    } = soak;

    crate::session::announce("flood stopped: final reads, then stopping the agent");
    receiver.wait_idle(Duration::from_millis(300), Duration::from_secs(3));
    // The final reads see a bucket store at rest: created - tracked is exact here.
    let (after, _) = ops.cli(&["stats", "--json"])?;
    let (explain, _) = ops.cli(&["explain", &POLITE.to_string(), "--json"])?;
    let (status, _) = ops.cli(&["status", "--json"])?;
    let hwm_kib = vm_field(pid, "VmHWM:")?;
    let log = agent.log();
    let exit = agent.stop()?;
    let received = receiver.stop()?;
    machine["loadavg_after"] = json!(crate::session::loadavg());

    let polite_stats = received
        .sources
        .get(&std::net::IpAddr::from(POLITE))
        .copied()
        .unwrap_or_default();
    let since = |name: &str| {
        counter(&after["global"][name]).saturating_sub(counter(&before["global"][name]))
    };
    let fin = Final {
        created: since("new_buckets"),
        evicted_full: since("evicted_full"),
        evicted_lost: since("evicted_lost"),
        tracked: counter(&after["buckets"]["tracked"]),
        tracked0: counter(&before["buckets"]["tracked"]),
        capacity: counter(&after["buckets"]["capacity"]),
        frames: traffic.frames.load(Ordering::Relaxed),
        traffic_secs,
        polite_sent: traffic.polite_sent.load(Ordering::Relaxed),
        polite_skipped: traffic.polite_skipped.load(Ordering::Relaxed),
        polite_send_errors: traffic.polite_errors.load(Ordering::Relaxed),
        polite_received: polite_stats.packets,
        polite_duplicates: polite_stats.duplicates,
        socket_drops: received.socket_drops,
        polite_bucket: explain["bucket"].clone(),
        reloads_ok: counter(&status["reloads"]["ok"]),
        reloads_failed: counter(&status["reloads"]["failed"]),
        reloads_done: reloads.len() as u64,
        hwm_kib,
        log_warnings: log
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .map(str::to_owned)
            .collect(),
        agent_exit: exit.to_string(),
        errors: samples.iter().map(|s| s.errors.len()).sum(),
    };
    let (report, summary) = judge(&samples, &fin, duration, machine);
    print!("{}", report.table());
    let mut doc = report.json();
    doc["soak"] = summary;
    doc["samples"] = samples.iter().map(Sample::json).collect();
    doc["reloads"] = json!(reloads);
    doc["final"] = json!({ "stats": after, "status": status, "explain_polite": explain });
    write_json(&args.json, &doc)
}

/// Writes the soak's results to `path`.
fn write_json(path: &Path, doc: &Value) -> Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    fs::write(path, serde_json::to_string_pretty(doc)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("==> soak: results written to {}", path.display());
    Ok(())
}

impl Args {
    /// The CPU the traffic runs on, once the arguments are checked (and the caller is root).
    fn checked_cpu(&self) -> Result<usize> {
        if !ratelimit_testbed::is_root() {
            bail!("the soak needs root (network namespaces, XDP, BPF_PROG_TEST_RUN)");
        }
        if self.minutes <= 0.0 || self.interval <= 0.0 || self.reload_every <= 0.0 {
            bail!("--minutes, --interval and --reload-every must be positive");
        }
        Ok(self.cpu.unwrap_or_else(|| {
            thread::available_parallelism().map_or(1, std::num::NonZero::get) - 1
        }))
    }
}

/// The release agent on the testbed's receiving veth, with the soak's one rule.
fn start_agent(bed: &Testbed, args: &Args) -> Result<AgentProcess> {
    let config = format!(
        "[agent]\ninterfaces = [\"{}\"]\nmode = \"native\"\nmetrics = \"{METRICS}\"\n\
         max_buckets = {}\n\n[[rule]]\nname = \"{RULE}\"\nsource = \"0.0.0.0/0\"\nrate = {RATE}\n\
         burst = {BURST}\nper = \"source\"\n",
        bed.rx_if(),
        args.max_buckets
    );
    crate::session::announce(&format!(
        "starting the release agent on {} (native XDP, max_buckets {})",
        bed.rx_if(),
        args.max_buckets
    ));
    AgentProcess::start(bed.rx(), &config, &[])
}

/// What the soak's threads share while the traffic runs.
struct Soak<'a> {
    refs: &'a Refs,
    bed: &'a Testbed,
    ops: &'a Ops<'a>,
    receiver: &'a Receiver,
    traffic: Traffic,
    /// Set when the soak ends or a thread fails: the others stop.
    stop: AtomicBool,
    /// The agent's process id.
    pid: u32,
    /// The CPU of the generator and the polite sender.
    cpu: usize,
    duration: Duration,
    interval: Duration,
    reload_every: Duration,
    /// `evicted_full` and `evicted_lost` before the flood.
    evicted0: (u64, u64),
}

impl Soak<'_> {
    /// Says what the soak is about to do.
    fn announce(&self, minutes: f64) {
        crate::session::announce(&format!(
            "soak: {minutes:.1} min of random-source flood on CPU {}, polite source {POLITE} at \
             {POLITE_PPS} pps; a sample every {:.0} s, a reload every {:.0} s (Ctrl-C stops it \
             and cleans up)",
            self.cpu,
            self.interval.as_secs_f64(),
            self.reload_every.as_secs_f64()
        ));
    }

    /// Runs the flood and the polite source on threads of their own while this one samples
    /// (into `samples`) and reloads (into `reloads`), from `started` to the soak's end; the
    /// first error of any of them.
    fn drive(
        &self,
        agent: &mut AgentProcess,
        started: Instant,
        samples: &mut Vec<Sample>,
        reloads: &mut Vec<Value>,
    ) -> Result<()> {
        thread::scope(|s| -> Result<()> {
            let flood = s.spawn(|| self.until_stopped(|| self.flood()));
            let polite = s.spawn(|| self.until_stopped(|| self.polite()));
            let result = self.sample_loop(agent, started, samples, reloads);
            self.stop.store(true, Ordering::Relaxed);
            let flood = flood.join().expect("flood thread");
            let polite = polite.join().expect("polite sender thread");
            result.and(flood).and(polite)
        })
    }

    /// Runs `body`, then tells the other threads to stop (it ended, or failed).
    fn until_stopped(&self, body: impl FnOnce() -> Result<()>) -> Result<()> {
        let result = body();
        self.stop.store(true, Ordering::Relaxed);
        result
    }

    /// The random-source flood, in chunks of [`CHUNK`], until told to stop.
    fn flood(&self) -> Result<()> {
        while !self.stop.load(Ordering::Relaxed) {
            crate::session::check_interrupted()?;
            let b = self.bed.blast_random(self.refs, CHUNK, self.cpu)?;
            self.traffic.frames.fetch_add(b.frames, Ordering::Relaxed);
        }
        Ok(())
    }

    /// The polite source, [`POLITE_PPS`] through the stack to the receiver, until told to stop.
    fn polite(&self) -> Result<()> {
        pin_to_cpu(self.cpu)?;
        let socket = bind_udp(self.bed.gen(), SocketAddr::new(POLITE.into(), 0))?;
        let dst = self.receiver.local_addr();
        let t = &self.traffic;
        while !self.stop.load(Ordering::Relaxed) {
            let r = send_udp(&socket, dst, POLITE_PPS, CHUNK, 64)?;
            t.polite_sent.fetch_add(r.sent, Ordering::Relaxed);
            t.polite_skipped.fetch_add(r.skipped, Ordering::Relaxed);
            t.polite_errors.fetch_add(r.errors, Ordering::Relaxed);
        }
        Ok(())
    }

    /// A sample every `interval` (the resident memory at rest read every second between them),
    /// a reload every `reload_every`, until the soak's end; stops at Ctrl-C, at a traffic thread
    /// that failed and at the agent exiting.
    fn sample_loop(
        &self,
        agent: &mut AgentProcess,
        started: Instant,
        samples: &mut Vec<Sample>,
        reloads: &mut Vec<Value>,
    ) -> Result<()> {
        let mut last = (
            Instant::now(),
            self.traffic.frames.load(Ordering::Relaxed),
            self.bed.rx_stats()?,
            cpu_time_ns(self.pid)?,
        );
        let end = started + self.duration;
        let mut next_sample = started + self.interval;
        let mut next_reload = started + self.reload_every;
        let mut reload_no = 0u64;
        let mut at_rest: Vec<u64> = Vec::new();
        let mut next_reading = Instant::now();
        loop {
            while Instant::now() < next_sample.min(end) {
                crate::session::check_interrupted()?;
                if self.stop.load(Ordering::Relaxed) {
                    bail!("a traffic thread stopped early (see its error below)");
                }
                if !agent.is_running() {
                    bail!("the agent exited during the soak. Log:\n{}", agent.log());
                }
                if Instant::now() >= next_reading {
                    at_rest.push(rss_kib(self.pid)?);
                    next_reading += Duration::from_secs(1);
                }
                thread::sleep(Duration::from_millis(100));
            }
            let now = Instant::now();
            let mut sample = self
                .ops
                .sample(self.pid, &self.traffic, self.receiver, &mut last)?;
            at_rest.push(sample.rss_kib);
            sample.rss_min_kib = at_rest.iter().copied().min().unwrap_or(0);
            sample.rss_max_kib = at_rest.iter().copied().max().unwrap_or(0);
            at_rest.clear();
            sample.t = (now - started).as_secs_f64();
            // (Without an answer from `stats`, capacity is 0 and the sample has no count.)
            if sample.capacity > 0 {
                sample.evicted = evictions(self.evicted0, sample.evicted_full, sample.evicted_lost);
            }
            println!("{}", sample.row());
            samples.push(sample);
            if now >= end {
                return Ok(());
            }
            if Instant::now() >= next_reload {
                let way = Reload::ALL[usize::try_from(reload_no).unwrap_or(0) % 3];
                reload_no += 1;
                reloads.push(self.ops.reload(agent, way, reload_no)?);
                next_reload += self.reload_every;
            }
            next_sample += self.interval;
            next_reading = Instant::now();
        }
    }
}

/// What the soak ended with.
#[derive(Default)]
struct Final {
    /// Buckets created during the soak (at rest, after the flood).
    created: u64,
    /// Evictions counted by the program during the soak (at rest), by state.
    evicted_full: u64,
    evicted_lost: u64,
    tracked: u64,
    tracked0: u64,
    capacity: u64,
    frames: u64,
    traffic_secs: f64,
    polite_sent: u64,
    polite_skipped: u64,
    polite_send_errors: u64,
    polite_received: u64,
    polite_duplicates: u64,
    socket_drops: Option<u64>,
    polite_bucket: Value,
    reloads_ok: u64,
    reloads_failed: u64,
    reloads_done: u64,
    hwm_kib: u64,
    log_warnings: Vec<String>,
    agent_exit: String,
    errors: usize,
}
