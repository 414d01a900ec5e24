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

use std::{
    fmt::Write as _,
    fs,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Command, Stdio},
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use ratelimit_testbed::{agent_binary, bind_udp, in_netns, send_udp, AgentProcess, Receiver};
use serde_json::{json, Value};

use crate::{
    agent::{agent_pid, rss_kib, vm_field},
    e2e::{Testbed, BURST, POLITE, POLITE_PPS, RATE, SERVER},
    generator::pin_to_cpu,
    refs::Refs,
    report::{Figure, Report, Target},
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
/// their figures compare). A source's first packet creates its bucket, so the flood fills it in
/// seconds and it evicts for the rest of the soak (`--max-buckets 1048576` for the default size,
/// which fills as fast now).
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

pub fn run(args: &Args) -> Result<()> {
    if !ratelimit_testbed::is_root() {
        bail!("the soak needs root (network namespaces, XDP, BPF_PROG_TEST_RUN)");
    }
    if args.minutes <= 0.0 || args.interval <= 0.0 || args.reload_every <= 0.0 {
        bail!("--minutes, --interval and --reload-every must be positive");
    }
    let cpu = args
        .cpu
        .unwrap_or_else(|| thread::available_parallelism().map_or(1, std::num::NonZero::get) - 1);
    let duration = Duration::from_secs_f64(args.minutes * 60.0);
    let interval = Duration::from_secs_f64(args.interval);
    let reload_every = Duration::from_secs_f64(args.reload_every);
    let mut machine = crate::session::machine();

    crate::session::announce("loading the random-source generator; creating namespaces");
    let refs = Refs::load()?;
    let bed = Testbed::new()?;
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
    let mut agent = AgentProcess::start(bed.rx(), &config, &[])?;
    let pid = agent_pid(agent.config_path())?;
    let ops = Ops {
        socket: agent.socket_path().to_path_buf(),
        bed: &bed,
    };
    let (before, _) = ops.cli(&["stats", "--json"])?;
    let created0 = counter(&before["global"]["new_buckets"]);
    let tracked0 = counter(&before["buckets"]["tracked"]);
    let evicted0 = (
        counter(&before["global"]["evicted_full"]),
        counter(&before["global"]["evicted_lost"]),
    );
    let receiver = Receiver::bind(bed.rx(), SocketAddr::new(SERVER.into(), 0))?;
    let dst = receiver.local_addr();

    crate::session::announce(&format!(
        "soak: {:.1} min of random-source flood on CPU {cpu}, polite source {POLITE} at \
         {POLITE_PPS} pps; a sample every {:.0} s, a reload every {:.0} s (Ctrl-C stops it and \
         cleans up)",
        args.minutes,
        interval.as_secs_f64(),
        reload_every.as_secs_f64()
    ));
    println!("{}", Sample::header());
    let traffic = Traffic::default();
    let stop = AtomicBool::new(false);
    let mut samples: Vec<Sample> = Vec::new();
    let mut reloads: Vec<Value> = Vec::new();
    let started = Instant::now();
    let sampled = thread::scope(|s| -> Result<()> {
        let flood = s.spawn(|| -> Result<()> {
            let result = (|| {
                while !stop.load(Ordering::Relaxed) {
                    crate::session::check_interrupted()?;
                    let b = bed.blast_random(&refs, CHUNK, cpu)?;
                    traffic.frames.fetch_add(b.frames, Ordering::Relaxed);
                }
                Ok(())
            })();
            stop.store(true, Ordering::Relaxed);
            result
        });
        let polite = s.spawn(|| -> Result<()> {
            let result = (|| {
                pin_to_cpu(cpu)?;
                let socket = bind_udp(bed.gen(), SocketAddr::new(POLITE.into(), 0))?;
                while !stop.load(Ordering::Relaxed) {
                    let r = send_udp(&socket, dst, POLITE_PPS, CHUNK, 64)?;
                    traffic.polite_sent.fetch_add(r.sent, Ordering::Relaxed);
                    traffic
                        .polite_skipped
                        .fetch_add(r.skipped, Ordering::Relaxed);
                    traffic.polite_errors.fetch_add(r.errors, Ordering::Relaxed);
                }
                Ok(())
            })();
            stop.store(true, Ordering::Relaxed);
            result
        });
        let result = (|| -> Result<()> {
            let mut last = (
                Instant::now(),
                traffic.frames.load(Ordering::Relaxed),
                bed.rx_stats()?,
                cpu_time_ns(pid)?,
            );
            let mut next_sample = started + interval;
            let mut next_reload = started + reload_every;
            let mut reload_no = 0u64;
            let mut at_rest: Vec<u64> = Vec::new();
            let mut next_reading = Instant::now();
            loop {
                // Wait for the next sample, watching for Ctrl-C, a traffic thread that failed and
                // the agent exiting.
                let end = started + duration;
                while Instant::now() < next_sample.min(end) {
                    crate::session::check_interrupted()?;
                    if stop.load(Ordering::Relaxed) {
                        bail!("a traffic thread stopped early (see its error below)");
                    }
                    if !agent.is_running() {
                        bail!("the agent exited during the soak. Log:\n{}", agent.log());
                    }
                    if Instant::now() >= next_reading {
                        at_rest.push(rss_kib(pid)?);
                        next_reading += Duration::from_secs(1);
                    }
                    thread::sleep(Duration::from_millis(100));
                }
                let now = Instant::now();
                let mut sample = ops.sample(pid, &traffic, &receiver, &mut last)?;
                at_rest.push(sample.rss_kib);
                sample.rss_min_kib = at_rest.iter().copied().min().unwrap_or(0);
                sample.rss_max_kib = at_rest.iter().copied().max().unwrap_or(0);
                at_rest.clear();
                sample.t = (now - started).as_secs_f64();
                // (Without an answer from `stats`, capacity is 0 and the sample has no count.)
                if sample.capacity > 0 {
                    sample.evicted = evictions(evicted0, sample.evicted_full, sample.evicted_lost);
                }
                println!("{}", sample.row());
                samples.push(sample);
                if now >= end {
                    break;
                }
                if Instant::now() >= next_reload {
                    let way = Reload::ALL[usize::try_from(reload_no).unwrap_or(0) % 3];
                    reload_no += 1;
                    reloads.push(ops.reload(&mut agent, way, reload_no)?);
                    next_reload += reload_every;
                }
                next_sample += interval;
                next_reading = Instant::now();
            }
            Ok(())
        })();
        stop.store(true, Ordering::Relaxed);
        let flood = flood.join().expect("flood thread");
        let polite = polite.join().expect("polite sender thread");
        result.and(flood).and(polite)
    });
    let traffic_secs = started.elapsed().as_secs_f64();
    sampled?;

    crate::session::announce("flood stopped: final reads, then stopping the agent");
    receiver.wait_idle(Duration::from_millis(300), Duration::from_secs(3));
    // The final reads see a bucket store at rest: created - tracked is exact here.
    let (after, _) = ops.cli(&["stats", "--json"])?;
    let (explain, _) = ops.cli(&["explain", &POLITE.to_string(), "--json"])?;
    let (status, _) = ops.cli(&["status", "--json"])?;
    let hwm = vm_field(pid, "VmHWM:")?;
    let log = agent.log();
    let exit = agent.stop()?;
    let received = receiver.stop()?;
    machine["loadavg_after"] = json!(crate::session::loadavg());

    let polite_stats = received
        .sources
        .get(&std::net::IpAddr::from(POLITE))
        .copied()
        .unwrap_or_default();
    let fin = Final {
        created: counter(&after["global"]["new_buckets"]).saturating_sub(created0),
        evicted_full: counter(&after["global"]["evicted_full"]).saturating_sub(evicted0.0),
        evicted_lost: counter(&after["global"]["evicted_lost"]).saturating_sub(evicted0.1),
        tracked: counter(&after["buckets"]["tracked"]),
        tracked0,
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
        hwm_kib: hwm,
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
    if let Some(dir) = args.json.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    fs::write(&args.json, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", args.json.display()))?;
    eprintln!("==> soak: results written to {}", args.json.display());
    Ok(())
}

/// How a reload is asked for.
#[derive(Clone, Copy, Debug)]
enum Reload {
    /// The config file is replaced (write and rename) with an equivalent one: the agent's file
    /// watcher reloads it.
    File,
    /// SIGHUP to the agent.
    Sighup,
    /// `ratelimit rules reload`.
    Cli,
}

impl Reload {
    const ALL: [Reload; 3] = [Reload::File, Reload::Sighup, Reload::Cli];

    fn name(self) -> &'static str {
        match self {
            Reload::File => "config file rewritten",
            Reload::Sighup => "SIGHUP",
            Reload::Cli => "ratelimit rules reload",
        }
    }
}

/// The agent's operator paths, and what the soak reads besides.
struct Ops<'a> {
    socket: PathBuf,
    bed: &'a Testbed,
}

impl Ops<'_> {
    /// `ratelimit --socket S ARGS`, its stdout parsed as JSON, and how long it took. Killed and
    /// failed after [`CALL_TIMEOUT`].
    fn cli(&self, args: &[&str]) -> Result<(Value, Duration)> {
        let what = format!("ratelimit {}", args.join(" "));
        let t0 = Instant::now();
        let mut child = Command::new(agent_binary())
            .arg("--socket")
            .arg(&self.socket)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting `{what}`"))?;
        let (mut out, mut err) = (
            child.stdout.take().expect("piped"),
            child.stderr.take().expect("piped"),
        );
        let reader = thread::spawn(move || {
            let (mut o, mut e) = (Vec::new(), Vec::new());
            let _ = out.read_to_end(&mut o);
            let _ = err.read_to_end(&mut e);
            (o, e)
        });
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if t0.elapsed() > CALL_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                bail!("`{what}` did not answer within {CALL_TIMEOUT:?}");
            }
            thread::sleep(Duration::from_millis(5));
        };
        let elapsed = t0.elapsed();
        let (o, e) = reader.join().expect("reader thread");
        if !status.success() {
            bail!(
                "`{what}` failed ({status}): {}",
                String::from_utf8_lossy(&e).trim()
            );
        }
        let v = serde_json::from_slice(&o)
            .with_context(|| format!("`{what}` printed {:?}", String::from_utf8_lossy(&o)))?;
        Ok((v, elapsed))
    }

    /// `GET /metrics` from the agent's endpoint (in the receiving namespace), and how long it took.
    fn metrics(&self) -> Result<(String, Duration)> {
        let t0 = Instant::now();
        let addr: SocketAddr = METRICS.parse().expect("a socket address");
        let mut conn = in_netns(self.bed.rx(), || {
            TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        })
        .with_context(|| format!("connecting to the metrics endpoint {METRICS}"))?;
        conn.set_read_timeout(Some(CALL_TIMEOUT))?;
        conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")?;
        let mut text = String::new();
        conn.read_to_string(&mut text)
            .context("reading the metrics answer")?;
        let elapsed = t0.elapsed();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        if !head.starts_with("HTTP/1.1 200") {
            bail!(
                "GET /metrics answered {:?}",
                head.lines().next().unwrap_or("")
            );
        }
        Ok((body.to_string(), elapsed))
    }

    /// One sample: /proc first (so that the figures are those of the agent at rest between
    /// calls), then every operator path in turn.
    fn sample(
        &self,
        pid: u32,
        traffic: &Traffic,
        receiver: &Receiver,
        last: &mut (Instant, u64, (u64, u64), u64),
    ) -> Result<Sample> {
        let now = Instant::now();
        let frames = traffic.frames.load(Ordering::Relaxed);
        let rx = self.bed.rx_stats()?;
        let cpu = cpu_time_ns(pid)?;
        let secs = (now - last.0).as_secs_f64();
        #[expect(clippy::cast_precision_loss, reason = "counts and nanoseconds")]
        let mut s = Sample {
            rss_kib: rss_kib(pid)?,
            hwm_kib: vm_field(pid, "VmHWM:")?,
            cpu_pct: cpu.saturating_sub(last.3) as f64 / 1e9 / secs * 100.0,
            gen_mpps: (frames - last.1) as f64 / secs / 1e6,
            rx_mpps: (rx.0 - (last.2).0) as f64 / secs / 1e6,
            rx_ring_drops: rx.1 - (last.2).1,
            polite_sent: traffic.polite_sent.load(Ordering::Relaxed),
            polite_received: receiver.counts().get(&POLITE.into()).copied().unwrap_or(0),
            ..Sample::default()
        };
        *last = (now, frames, rx, cpu);
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        match self.cli(&["status", "--json"]) {
            Ok((v, d)) => {
                s.ms_status = ms(d);
                s.status_tracked = counter(&v["buckets_tracked"]);
                s.reloads_ok = counter(&v["reloads"]["ok"]);
                s.reloads_failed = counter(&v["reloads"]["failed"]);
            }
            Err(e) => s.errors.push(format!("{e:#}")),
        }
        match self.cli(&["stats", "--json"]) {
            Ok((v, d)) => {
                s.ms_stats = ms(d);
                s.tracked = counter(&v["buckets"]["tracked"]);
                s.capacity = counter(&v["buckets"]["capacity"]);
                s.new_buckets = counter(&v["global"]["new_buckets"]);
                s.bucket_errors = counter(&v["global"]["bucket_errors"]);
                s.evicted_full = counter(&v["global"]["evicted_full"]);
                s.evicted_lost = counter(&v["global"]["evicted_lost"]);
                if v["global"]["evicted_full"].is_null() || v["global"]["evicted_lost"].is_null() {
                    s.errors
                        .push("stats: no evicted_full or evicted_lost counter".to_string());
                }
                if let Some(rule) = v["rules"]
                    .as_array()
                    .and_then(|r| r.iter().find(|r| r["name"] == RULE))
                {
                    s.passed = counter(&rule["packets"]["passed"]);
                    s.dropped_rate = counter(&rule["packets"]["dropped_rate"]);
                    s.no_bucket = counter(&rule["packets"]["no_bucket"]);
                }
            }
            Err(e) => s.errors.push(format!("{e:#}")),
        }
        match self.cli(&["top", "-n", "5", "--interval-ms", "500", "--json"]) {
            Ok((v, d)) => {
                s.ms_top = ms(d);
                s.top_active = counter(&v["active"]);
            }
            Err(e) => s.errors.push(format!("{e:#}")),
        }
        match self.cli(&["explain", &POLITE.to_string(), "--json"]) {
            Ok((v, d)) => {
                s.ms_explain = ms(d);
                let b = &v["bucket"];
                s.polite_bucket_passed = b["passed"].as_u64();
                s.polite_bucket_dropped = b["dropped"].as_u64();
                s.polite_bucket_age_secs = b["age_secs"].as_f64();
            }
            Err(e) => s.errors.push(format!("{e:#}")),
        }
        match self.metrics() {
            Ok((text, d)) => {
                s.ms_metrics = ms(d);
                s.metrics_new_buckets = metric(&text, "ratelimit_new_buckets_total").unwrap_or(0);
                s.metrics_tracked = metric(&text, "ratelimit_buckets_tracked").unwrap_or(0);
                s.metrics_evicted_full = metric(&text, EVICTIONS_FULL).unwrap_or(0);
                s.metrics_evicted_lost = metric(&text, EVICTIONS_LOST).unwrap_or(0);
                if metric(&text, EVICTIONS_FULL).is_none() {
                    s.errors.push(format!("metrics: no {EVICTIONS_FULL}"));
                }
                if metric(&text, "ratelimit_new_buckets_total").is_none() {
                    s.errors
                        .push("metrics: no ratelimit_new_buckets_total".to_string());
                }
            }
            Err(e) => s.errors.push(format!("metrics: {e:#}")),
        }
        for e in &s.errors {
            eprintln!("    soak: {e}");
        }
        Ok(s)
    }

    /// Makes the agent reload its (unchanged) config `way`, and waits (up to 30 s) for its log to
    /// say so.
    fn reload(&self, agent: &mut AgentProcess, way: Reload, n: u64) -> Result<Value> {
        let reloaded = |log: &str| log.matches("ratelimit::agent: reloaded").count();
        let before = reloaded(&agent.log());
        let t0 = Instant::now();
        let mut error = None;
        match way {
            Reload::File => {
                let path = agent.config_path();
                let text = fs::read_to_string(path)?;
                let mut new: String = text
                    .lines()
                    .filter(|l| !l.starts_with("# soak reload"))
                    .fold(String::new(), |mut acc, l| {
                        let _ = writeln!(acc, "{l}");
                        acc
                    });
                let _ = writeln!(new, "# soak reload {n}: rules unchanged");
                let tmp = path.with_extension("toml.new");
                fs::write(&tmp, new)?;
                fs::rename(&tmp, path)?;
            }
            Reload::Sighup => {
                let pid = agent_pid(agent.config_path())?;
                // SAFETY: kill has no memory-safety preconditions.
                if unsafe { libc::kill(libc::pid_t::try_from(pid)?, libc::SIGHUP) } != 0 {
                    error = Some(format!("SIGHUP: {}", std::io::Error::last_os_error()));
                }
            }
            Reload::Cli => {
                if let Err(e) = self.cli(&["rules", "reload", "--json"]) {
                    error = Some(format!("{e:#}"));
                }
            }
        }
        let mut done = false;
        while error.is_none() && t0.elapsed() < Duration::from_secs(30) {
            if reloaded(&agent.log()) > before {
                done = true;
                break;
            }
            thread::sleep(Duration::from_millis(50));
        }
        let secs = t0.elapsed().as_secs_f64();
        if !done && error.is_none() {
            error = Some("the agent did not log a reload within 30 s".into());
        }
        if let Some(e) = &error {
            eprintln!("    soak: reload by {}: {e}", way.name());
        } else {
            eprintln!(
                "    soak: reloaded by {} in {:.0} ms",
                way.name(),
                secs * 1000.0
            );
        }
        Ok(json!({ "n": n, "way": way.name(), "ok": done, "seconds": secs, "error": error }))
    }
}

impl Sample {
    fn json(&self) -> Value {
        json!({
            "t": self.t,
            "rss_kib": self.rss_kib,
            "rss_min_kib": self.rss_min_kib,
            "rss_max_kib": self.rss_max_kib,
            "hwm_kib": self.hwm_kib,
            "cpu_pct": self.cpu_pct,
            "gen_mpps": self.gen_mpps,
            "rx_mpps": self.rx_mpps,
            "rx_ring_drops": self.rx_ring_drops,
            "tracked": self.tracked,
            "capacity": self.capacity,
            "new_buckets": self.new_buckets,
            "bucket_errors": self.bucket_errors,
            "passed": self.passed,
            "dropped_rate": self.dropped_rate,
            "no_bucket": self.no_bucket,
            "evicted": self.evicted,
            "evicted_full": self.evicted_full,
            "evicted_lost": self.evicted_lost,
            "metrics_evicted_full": self.metrics_evicted_full,
            "metrics_evicted_lost": self.metrics_evicted_lost,
            "status_tracked": self.status_tracked,
            "reloads_ok": self.reloads_ok,
            "reloads_failed": self.reloads_failed,
            "top_active": self.top_active,
            "metrics_new_buckets": self.metrics_new_buckets,
            "metrics_tracked": self.metrics_tracked,
            "polite_bucket_passed": self.polite_bucket_passed,
            "polite_bucket_dropped": self.polite_bucket_dropped,
            "polite_bucket_age_secs": self.polite_bucket_age_secs,
            "polite_sent": self.polite_sent,
            "polite_received": self.polite_received,
            "ms_status": self.ms_status,
            "ms_stats": self.ms_stats,
            "ms_top": self.ms_top,
            "ms_explain": self.ms_explain,
            "ms_metrics": self.ms_metrics,
            "errors": self.errors,
        })
    }

    fn header() -> String {
        format!(
            "{:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>11} {:>7} {:>6} {:>14} {:>8} {:>24}",
            "time",
            "gen",
            "rx",
            "tracked",
            "created",
            "evicted",
            "rss at rest",
            "hwm",
            "cpu",
            "polite",
            "polite",
            "ms: status stats top metrics"
        ) + "\n"
            + &format!(
                "{:>6} {:>6} {:>6} {:>9} {:>9} {:>9} {:>11} {:>7} {:>6} {:>14} {:>8}",
                "s", "Mpps", "Mpps", "", "", "", "MiB", "MiB", "%", "received", "dropped"
            )
    }

    #[expect(clippy::cast_precision_loss, reason = "KiB to MiB")]
    fn row(&self) -> String {
        format!(
            "{:>6.0} {:>6.3} {:>6.3} {:>9} {:>9} {:>9} {:>11} {:>7.1} {:>6.2} {:>14} {:>8} {:>6.0} {:>5.0} {:>5.0} {:>5.0}{}",
            self.t,
            self.gen_mpps,
            self.rx_mpps,
            self.tracked,
            self.new_buckets,
            self.evicted,
            format!(
                "{:.1}-{:.1}",
                self.rss_min_kib as f64 / 1024.0,
                self.rss_max_kib as f64 / 1024.0
            ),
            self.hwm_kib as f64 / 1024.0,
            self.cpu_pct,
            self.polite_received,
            self.polite_bucket_dropped
                .map_or_else(|| "-".into(), |d| d.to_string()),
            self.ms_status,
            self.ms_stats,
            self.ms_top,
            self.ms_metrics,
            if self.errors.is_empty() {
                String::new()
            } else {
                format!("  {} errors", self.errors.len())
            }
        )
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

/// Evictions the program counted since the start (`evicted_full + evicted_lost`), given the two
/// counters at the start and now.
#[expect(
    clippy::cast_possible_wrap,
    reason = "bucket counts are far below 2^63"
)]
fn evictions(at_start: (u64, u64), full: u64, lost: u64) -> i64 {
    (full.saturating_sub(at_start.0) + lost.saturating_sub(at_start.1)) as i64
}

/// Buckets that left the store since the start, by the counts alone: created since then minus
/// the growth of the tracked count (the evictions, as long as no rule is removed).
#[expect(
    clippy::cast_possible_wrap,
    reason = "bucket counts are far below 2^63"
)]
fn departed(created: u64, tracked0: u64, tracked: u64) -> i64 {
    created as i64 - (tracked as i64 - tracked0 as i64)
}

/// `ratelimit_bucket_evictions_total` of a full bucket, as the metrics name it.
const EVICTIONS_FULL: &str = "ratelimit_bucket_evictions_total{state=\"full\"}";
/// ... and of a bucket in debt.
const EVICTIONS_LOST: &str = "ratelimit_bucket_evictions_total{state=\"lost\"}";

/// A counter from a JSON answer (0 if absent).
fn counter(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// The value of an unlabelled metric in an OpenMetrics text.
fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?.strip_prefix(' ')?;
        rest.split_whitespace()
            .next()?
            .parse::<f64>()
            .ok()
            .map(|v| {
                #[expect(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    reason = "counters and gauges of whole numbers"
                )]
                let v = v as u64;
                v
            })
    })
}

/// CPU time of process `pid`, user and system, threads that have exited included, in ns
/// (/proc/PID/stat; clock-tick resolution, fine over a sample interval). Summing the live threads'
/// schedstat, as the bench's short windows do, would lose the time of the agent's blocking-pool
/// threads when they exit.
fn cpu_time_ns(pid: u32) -> Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) in parentheses: field 3 (state) is
    // the first; utime and stime are fields 14 and 15.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("no ')' in /proc/PID/stat")?;
    let fields: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // SAFETY: sysconf has no preconditions.
    let tick = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|&t| t > 0)
        .unwrap_or(100);
    Ok(fields.iter().sum::<u64>() * 1_000_000_000 / tick)
}

/// Least-squares slope of `(x, y)`.
fn slope(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 3 {
        return None;
    }
    #[expect(clippy::cast_precision_loss, reason = "a few hundred points")]
    let n = points.len() as f64;
    let (mx, my) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

const SECTION_TRAFFIC: &str = "Soak: traffic (each run is one sample interval)";
const SECTION_MAP: &str = "Soak: bucket store (from `ratelimit stats --json`, each sample)";
const SECTION_AGENT: &str =
    "Soak: agent (release build; /proc and its operator paths, each sample)";

/// The table's figures, the verdicts and a summary for the JSON.
#[expect(
    clippy::too_many_lines,
    clippy::cast_precision_loss,
    reason = "one verdict after the other; counts as f64"
)]
fn judge(samples: &[Sample], fin: &Final, duration: Duration, machine: Value) -> (Report, Value) {
    let mut report = Report {
        machine,
        ..Report::default()
    };
    let col = |f: &dyn Fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<f64>>();
    let mut fig = |key: &str, section: &'static str, label: &str, unit: &'static str, runs| {
        report.add(Figure {
            key: format!("soak.{key}"),
            section,
            label: label.into(),
            unit,
            runs,
            baseline: None,
            detail: Value::Null,
        });
    };
    let capacity = fin.capacity.max(1);
    let full_at = samples
        .iter()
        .find(|s| s.tracked as f64 >= FULL_SHARE * capacity as f64)
        .map(|s| s.t);
    // Per-interval rates of bucket creation, and of eviction once the map is full.
    let mut created_ps = Vec::new();
    let (mut evicted_ps, mut lost_ps) = (Vec::new(), Vec::new());
    for w in samples.windows(2) {
        let dt = w[1].t - w[0].t;
        if dt > 0.0 {
            created_ps.push(w[1].new_buckets.saturating_sub(w[0].new_buckets) as f64 / dt);
            if full_at.is_some_and(|t| w[0].t >= t) {
                evicted_ps.push((w[1].evicted - w[0].evicted) as f64 / dt);
                lost_ps.push(w[1].evicted_lost.saturating_sub(w[0].evicted_lost) as f64 / dt);
            }
        }
    }
    fig(
        "gen_mpps",
        SECTION_TRAFFIC,
        "generator: random-source frames sent",
        "Mpps",
        col(&|s| s.gen_mpps),
    );
    fig(
        "rx_mpps",
        SECTION_TRAFFIC,
        "receiving veth: frames handled (rx_packets)",
        "Mpps",
        col(&|s| s.rx_mpps),
    );
    fig(
        "tracked",
        SECTION_MAP,
        "buckets tracked",
        "buckets",
        col(&|s| s.tracked as f64),
    );
    fig(
        "created_per_sec",
        SECTION_MAP,
        "buckets created (new_buckets), per second",
        "1/s",
        created_ps,
    );
    fig(
        "evicted_per_sec",
        SECTION_MAP,
        "buckets evicted (evicted_full + evicted_lost) per second, full",
        "1/s",
        evicted_ps,
    );
    fig(
        "evicted_lost_per_sec",
        SECTION_MAP,
        "of which in debt (evicted_lost) per second, full",
        "1/s",
        lost_ps,
    );
    fig(
        "rss",
        SECTION_AGENT,
        "agent resident memory (VmRSS)",
        "MiB",
        col(&|s| s.rss_kib as f64 / 1024.0),
    );
    fig(
        "cpu",
        SECTION_AGENT,
        "agent CPU, operator calls included",
        "% core",
        col(&|s| s.cpu_pct),
    );
    for (key, label, f) in [
        (
            "ms_status",
            "ratelimit status --json",
            (|s: &Sample| s.ms_status) as fn(&Sample) -> f64,
        ),
        ("ms_stats", "ratelimit stats --json", |s| s.ms_stats),
        (
            "ms_top",
            "ratelimit top -n 5 --interval-ms 500 --json",
            |s| s.ms_top,
        ),
        ("ms_explain", "ratelimit explain <polite> --json", |s| {
            s.ms_explain
        }),
        ("ms_metrics", "GET /metrics", |s| s.ms_metrics),
    ] {
        fig(key, SECTION_AGENT, label, "ms", col(&f));
    }

    let mut targets = Vec::new();
    // 1. The flood is larger than the bucket map.
    let space = f64::from(1u32 << RANDOM_BITS);
    let distinct = space * (1.0 - (-(fin.frames as f64) / space).exp());
    targets.push(Target {
        goal: "the flood offers more sources than the bucket store can track".into(),
        met: Some(distinct > capacity as f64 && fin.created > capacity),
        evidence: format!(
            "{} frames with 24 random source bits (2^24 = {} addresses): about {:.0} distinct \
             sources (2^24 x (1 - e^(-frames/2^24))), {:.1}x the capacity of {capacity}; {} \
             buckets created ({:.2}x the capacity)",
            fin.frames,
            1u32 << RANDOM_BITS,
            distinct,
            distinct / capacity as f64,
            fin.created,
            fin.created as f64 / capacity as f64,
        ),
    });
    // 2. Evictions counted by the program, store at capacity, never above it.
    let evicted = (fin.evicted_full + fin.evicted_lost) as i64;
    let left = departed(fin.created, fin.tracked0, fin.tracked);
    let max_tracked = samples
        .iter()
        .map(|s| s.tracked.max(s.status_tracked).max(s.metrics_tracked))
        .max()
        .unwrap_or(0)
        .max(fin.tracked);
    let evicting_secs = full_at.map(|t| fin.traffic_secs - t);
    let evicted_since_full = full_at.and_then(|t| {
        let s = samples.iter().find(|s| s.t >= t)?;
        Some(evicted - s.evicted)
    });
    let last = samples.last();
    let metrics_agree = last.is_some_and(|s| {
        s.metrics_evicted_full == s.evicted_full && s.metrics_evicted_lost == s.evicted_lost
    });
    targets.push(Target {
        goal: "evictions are counted by the program: the store fills, evicts, and evicted_full + \
               evicted_lost = created - tracked at rest"
            .into(),
        met: Some(evicted > 0 && full_at.is_some() && evicted == left),
        evidence: format!(
            "{evicted} buckets evicted ({} full, {} lost); by the counts: created {} - tracked \
             at the end {} + tracked at the start {} = {left} ({}); full (>= {:.0}% of \
             {capacity}) from {}; {}; the metrics in the last sample (read a moment after \
             stats, so {} them during the flood): {} full, {} lost",
            fin.evicted_full,
            fin.evicted_lost,
            fin.created,
            fin.tracked,
            fin.tracked0,
            if evicted == left { "agree" } else { "DISAGREE" },
            FULL_SHARE * 100.0,
            full_at.map_or_else(|| "never".into(), |t| format!("{t:.0} s on")),
            match (evicted_since_full, evicting_secs) {
                (Some(e), Some(secs)) if secs > 0.0 => format!(
                    "{:.0} evictions/s while full ({e} in {secs:.0} s)",
                    e as f64 / secs
                ),
                _ => "no eviction rate (never full)".into(),
            },
            if metrics_agree {
                "agree with"
            } else {
                "differ from"
            },
            last.map_or(0, |s| s.metrics_evicted_full),
            last.map_or(0, |s| s.metrics_evicted_lost),
        ),
    });
    let lost_share = fin.evicted_lost as f64 / (evicted.max(1) as f64);
    targets.push(Target {
        goal: format!(
            "one-packet sources evict buckets that have refilled: evicted_lost <= {:.0}% of \
             evictions",
            LOST_SHARE * 100.0
        ),
        met: (evicted > 0).then_some(lost_share <= LOST_SHARE),
        evidence: format!(
            "{} of {evicted} evictions lost state ({:.3}%); {} were of full buckets",
            fin.evicted_lost,
            lost_share * 100.0,
            fin.evicted_full,
        ),
    });
    let over = samples
        .iter()
        .filter(|s| s.tracked.max(s.status_tracked).max(s.metrics_tracked) > capacity)
        .count();
    targets.push(Target {
        goal: "kernel side: the bucket store never tracks more than its capacity".into(),
        met: Some(over == 0 && !samples.is_empty()),
        evidence: format!(
            "largest tracked count {max_tracked} of {capacity} (status, stats and metrics; {over} \
             of {} samples above); at the end, at rest: {}; \
             bucket_errors {} (failed inserts, passed open), no_bucket {} at the end",
            samples.len(),
            fin.tracked,
            samples.last().map_or(0, |s| s.bucket_errors),
            samples.last().map_or(0, |s| s.no_bucket),
        ),
    });
    // 3. The polite source.
    let b = &fin.polite_bucket;
    let bucket_dropped = b["dropped"].as_u64();
    let bucket_age = b["age_secs"].as_f64();
    // Its bucket was created within a second of the start unless it was evicted since.
    let bucket_whole = bucket_age.is_some_and(|a| a + 5.0 >= fin.traffic_secs);
    let sample_drops = samples
        .iter()
        .filter_map(|s| s.polite_bucket_dropped)
        .max()
        .unwrap_or(0);
    targets.push(Target {
        goal: "the polite source (200 pps) is never dropped".into(),
        met: Some(
            fin.polite_sent > 0
                && fin.polite_received == fin.polite_sent
                && bucket_dropped == Some(0)
                && sample_drops == 0,
        ),
        evidence: format!(
            "sent {}, received {} ({} duplicates, {} send slots skipped, {} send errors, socket \
             drops {}); its bucket: dropped {}, passed {}, age {} ({}); most dropped in any \
             sample {sample_drops}",
            fin.polite_sent,
            fin.polite_received,
            fin.polite_duplicates,
            fin.polite_skipped,
            fin.polite_send_errors,
            fin.socket_drops
                .map_or_else(|| "?".into(), |d| d.to_string()),
            bucket_dropped.map_or_else(|| "? (no bucket)".into(), |d| d.to_string()),
            b["passed"]
                .as_u64()
                .map_or_else(|| "?".into(), |d| d.to_string()),
            bucket_age.map_or_else(|| "?".into(), |a| format!("{a:.0} s")),
            if bucket_whole {
                "never evicted: its count covers the soak"
            } else {
                "evicted or recreated: its count covers only its age"
            },
        ),
    });
    // 4. Memory. VmRSS at rest moves in a band: the allocator keeps some of the buffers of the
    // map walks behind `status`, `stats`, `top` and the metrics, and trims them now and then. A
    // leak raises the band's floor; a growing buffer raises its ceiling. Judged from the end of
    // the first minute, and not before the map is full (until then the walks grow with it).
    let settle = SETTLE
        .as_secs_f64()
        .min(duration.as_secs_f64() / 2.0)
        .max(full_at.unwrap_or(0.0));
    let window: Vec<&Sample> = samples.iter().filter(|s| s.t >= settle).collect();
    let mib = |k: f64| k / 1024.0;
    let memory =
        if window.len() >= 4 {
            let (first, last) = window.split_at(window.len() / 2);
            let lo = |h: &[&Sample]| h.iter().map(|s| s.rss_min_kib).min().unwrap_or(0) as f64;
            let hi = |h: &[&Sample]| h.iter().map(|s| s.rss_max_kib).max().unwrap_or(0) as f64;
            let (lo1, hi1, lo2, hi2) = (lo(first), hi(first), lo(last), hi(last));
            let tol = (2048.0f64).max(0.05 * lo1);
            let (t0, t1) = (window[0].t, window[window.len() - 1].t);
            let span = t1 - t0;
            // The floor's trend: the lowest VmRSS of each minute (of each sample in runs shorter
            // than four minutes), fitted.
            let group = if span >= 240.0 { 60.0 } else { 1e-9 };
            let mut floor: Vec<(f64, f64)> = Vec::new();
            for s in &window {
                let g = ((s.t - t0) / group).floor();
                let v = s.rss_min_kib as f64;
                match floor.last_mut() {
                    Some((gt, m)) if (*gt - g).abs() < 0.5 => *m = m.min(v),
                    _ => floor.push((g, v)),
                }
            }
            for p in &mut floor {
                p.0 = t0 + p.0 * group;
            }
            let at_sample: Vec<(f64, f64)> =
                window.iter().map(|s| (s.t, s.rss_kib as f64)).collect();
            let k_floor = slope(&floor);
            let k_rss = slope(&at_sample).unwrap_or(f64::NAN);
            let rising = k_floor.is_some_and(|k| k * span > tol);
            let met = lo2 <= lo1 + tol && hi2 <= hi1 + tol && !rising;
            (
                Some(met),
                format!(
                "from {t0:.0} s to {t1:.0} s ({} samples), VmRSS at rest: first half {:.1}..{:.1} \
                 MiB, second half {:.1}..{:.1} MiB (floor {:+.0} KiB, ceiling {:+.0} KiB; \
                 allowed {:.0} KiB = max(2 MiB, 5%)); least-squares slope of the {} floor {} \
                 ({} over the window); of VmRSS at every sample {:+.1} KiB/min; VmRSS {:.1} MiB \
                 at {t0:.0} s, {:.1} MiB at the end; peak VmHWM {:.1} MiB",
                window.len(),
                mib(lo1),
                mib(hi1),
                mib(lo2),
                mib(hi2),
                lo2 - lo1,
                hi2 - hi1,
                tol,
                if group > 1.0 { "per-minute" } else { "per-sample" },
                k_floor.map_or_else(|| "-".into(), |k| format!("{:+.1} KiB/min", k * 60.0)),
                k_floor.map_or_else(|| "-".into(), |k| format!("{:+.0} KiB", k * span)),
                k_rss * 60.0,
                mib(window[0].rss_kib as f64),
                mib(window[window.len() - 1].rss_kib as f64),
                mib(fin.hwm_kib as f64),
            ),
                k_floor.map_or(f64::NAN, |k| k * 60.0),
                k_rss * 60.0,
            )
        } else {
            (
                None,
                format!("too few samples from {settle:.0} s on (after the first minute, map full)"),
                f64::NAN,
                f64::NAN,
            )
        };
    targets.push(Target {
        goal:
            "agent memory is flat once the store is full: the band of VmRSS at rest neither rises \
               (floor, ceiling, floor's trend within max(2 MiB, 5%))"
                .into(),
        met: memory.0,
        evidence: memory.1.clone(),
    });
    // 5. The agent stayed up and answered.
    let reloads_ok = fin.reloads_failed == 0 && fin.reloads_ok >= fin.reloads_done;
    targets.push(Target {
        goal: "the agent never exited, answered every operator call, and reloaded every time"
            .into(),
        met: Some(fin.agent_exit.contains("exit status: 0") && fin.errors == 0 && reloads_ok),
        evidence: format!(
            "running until stopped (exit after SIGTERM: {}); {} samples x 5 calls, {} failed; \
             {} reloads asked, agent counted {} ok, {} failed; {} warnings or errors in its log",
            fin.agent_exit,
            samples.len(),
            fin.errors,
            fin.reloads_done,
            fin.reloads_ok,
            fin.reloads_failed,
            fin.log_warnings.len(),
        ),
    });
    report.targets = targets;
    report.notes = vec![
        format!(
            "Soak: {:.0} s of traffic; a figure's runs are its samples (intervals for rates). \
             Generator and polite sender share one CPU; the agent, the receiver and the \
             sampling have the other.",
            fin.traffic_secs
        ),
        "Evicted = the program's own counters, evicted_full (the bucket had refilled: nothing \
         lost) + evicted_lost (it was in debt), from `stats --json`, since the start; at rest they \
         must equal buckets created (new_buckets) - the growth of the tracked count, as no rule \
         is removed during the soak."
            .into(),
        format!(
            "A source's first packet creates its bucket: 1 frame in {:.1} created one here \
             (the others came from sources already tracked).",
            fin.frames as f64 / fin.created.max(1) as f64
        ),
    ];
    let summary = json!({
        "traffic_seconds": fin.traffic_secs,
        "frames": fin.frames,
        "distinct_sources_expected": distinct,
        "capacity": fin.capacity,
        "buckets_created": fin.created,
        "buckets_tracked_start": fin.tracked0,
        "buckets_tracked_end": fin.tracked,
        "evicted": evicted,
        "evicted_full": fin.evicted_full,
        "evicted_lost": fin.evicted_lost,
        "created_minus_tracked": left,
        "full_from_seconds": full_at,
        "evicted_since_full": evicted_since_full,
        "max_tracked": max_tracked,
        "polite": {
            "sent": fin.polite_sent,
            "received": fin.polite_received,
            "skipped": fin.polite_skipped,
            "send_errors": fin.polite_send_errors,
            "duplicates": fin.polite_duplicates,
            "socket_drops": fin.socket_drops,
            "bucket": fin.polite_bucket,
        },
        "memory_from_seconds": settle,
        "rss_floor_slope_kib_per_min": if memory.2.is_finite() { json!(memory.2) } else { Value::Null },
        "rss_slope_kib_per_min": if memory.3.is_finite() { json!(memory.3) } else { Value::Null },
        "vm_hwm_kib": fin.hwm_kib,
        "reloads": { "asked": fin.reloads_done, "ok": fin.reloads_ok, "failed": fin.reloads_failed },
        "agent_exit": fin.agent_exit,
        "failed_calls": fin.errors,
        "agent_log_warnings": fin.log_warnings,
    });
    (report, summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line() {
        let pts: Vec<(f64, f64)> = (0..10)
            .map(|i| (f64::from(i), 3.0 * f64::from(i) + 1.0))
            .collect();
        assert!((slope(&pts).unwrap() - 3.0).abs() < 1e-9);
        assert!(slope(&pts[..2]).is_none());
    }

    /// A 10-minute soak's samples: the map full from 90 s, VmRSS at rest `rss(t)` in KiB.
    fn soak(rss: impl Fn(usize, f64) -> u64) -> (Vec<Sample>, Final) {
        let samples: Vec<Sample> = (1..=60)
            .map(|i| {
                let t = 10.0 * f64::from(i);
                let r = rss(i as usize, t);
                Sample {
                    t,
                    rss_kib: r,
                    rss_min_kib: r,
                    rss_max_kib: r,
                    tracked: if t >= 90.0 { 131_000 } else { 1450 * i as u64 },
                    new_buckets: 1450 * i as u64,
                    ..Sample::default()
                }
            })
            .collect();
        let fin = Final {
            created: 87_000,
            tracked: 131_000,
            capacity: 131_072,
            frames: 400_000_000,
            traffic_secs: 601.0,
            ..Final::default()
        };
        (samples, fin)
    }

    fn memory_verdict(rss: impl Fn(usize, f64) -> u64) -> Option<bool> {
        let (samples, fin) = soak(rss);
        let (report, _) = judge(&samples, &fin, Duration::from_secs(600), Value::Null);
        report
            .targets
            .iter()
            .find(|t| t.goal.starts_with("agent memory"))
            .expect("a memory verdict")
            .met
    }

    #[test]
    fn memory_band_without_a_trend_is_flat() {
        // Three levels, switched at calls, as the allocator keeps or trims walk buffers.
        let levels = [54_000, 65_000, 73_700];
        assert_eq!(
            memory_verdict(|i, _| levels[(i * 7 + i / 3) % 3]),
            Some(true)
        );
        assert_eq!(memory_verdict(|_, _| 60_000), Some(true));
    }

    #[test]
    fn memory_growth_is_not_flat() {
        // 1 MiB a minute on top of the band.
        let levels = [54_000, 65_000, 73_700];
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "test"
        )]
        let leak = |i: usize, t: f64| levels[(i * 7 + i / 3) % 3] + (t / 60.0 * 1024.0) as u64;
        assert_eq!(memory_verdict(leak), Some(false));
        // A floor that creeps up while the ceiling stays: still a leak.
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "test"
        )]
        let creep = |i: usize, t: f64| {
            if i.is_multiple_of(2) {
                73_700
            } else {
                50_000 + (t * 30.0) as u64
            }
        };
        assert_eq!(memory_verdict(creep), Some(false));
    }

    #[test]
    fn metric_values() {
        let text = "# TYPE ratelimit_buckets_tracked gauge\nratelimit_buckets_tracked 12\n\
                    ratelimit_new_buckets_total 34\nratelimit_new_buckets_total_x 1\n";
        assert_eq!(metric(text, "ratelimit_buckets_tracked"), Some(12));
        assert_eq!(metric(text, "ratelimit_new_buckets_total"), Some(34));
        assert_eq!(metric(text, "ratelimit_missing"), None);
        let text = "ratelimit_bucket_evictions_total{state=\"full\"} 5\n\
                    ratelimit_bucket_evictions_total{state=\"lost\"} 0\n";
        assert_eq!(metric(text, EVICTIONS_FULL), Some(5));
        assert_eq!(metric(text, EVICTIONS_LOST), Some(0));
    }
}
