//! The Redis backend's scale (`--only redis`, issue #38): N simulated hosts (10, 100, 500, 1,000,
//! 2,000; `--quick`: 10 and 100) in this one process run the agent's exchange against a local
//! 3-master Redis Cluster ([`LocalRedisCluster`], started here on loopback and removed afterwards),
//! each with the real client and scripts (`ratelimit::cluster::redis::RedisStore`, its own
//! connection, as an agent has) and the budget divided as the exchange loop divides it
//! (`cluster::sync::round_of`, then `cluster::shares::share`), one round per sync interval
//! (100 ms, the default) with the default timeouts.
//!
//! Every host holds [`HEAVY`] keys shared by all hosts, each flooded at [`FLOOD`] x its
//! cluster budget of [`RATE`] pps and split 95/5 (5% of the hosts, at least one, receive 95% of
//! it; the others share the rest), and [`OWN`] keys of its own at [`OWN_PPS`]. Over
//! [`MEASURE`] s after a warm-up it measures, per host: the scripts Redis ran and the bytes it
//! read and wrote (its `INFO` deltas, summed over the masters, divided by N), Redis CPU (summed
//! over the masters, in cores), the round trip of a round (p50, p99), the rounds run and failed;
//! and admitted / budget: each host's share of each heavy key, from what the store returned,
//! applied to its demand with the program's arithmetic (`ratelimit_common::share_cost` of the
//! share word: the bucket refills at `1e9 / cost` pps), held from its round until the next or
//! until the shares lapse (the lag allowance, then the whole rate: fail open), integrated over
//! the window, summed over hosts and keys, over `HEAVY x RATE x seconds`.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _, Result};
use ratelimit::{
    cluster::{
        publish::KeyName,
        redis::{key_name, Entry, RedisStore},
        remote::{ClusterLimits, Limits},
        shares,
        sync::{round_of, Reading},
        timing::Timing,
    },
    config::{RedisConfig, DEFAULT_REDIS_COMMAND_TIMEOUT_MS, DEFAULT_REDIS_CONNECT_TIMEOUT_MS},
};
use ratelimit_testbed::{cluster_net::cpu_time, redis_local::LocalRedisCluster};
use serde_json::json;

use crate::{
    report::{median, Figure, Report},
    session::{announce, check_interrupted, loadavg, Options},
};

/// Masters of the local Redis Cluster.
pub const MASTERS: usize = 3;
/// Keys every host holds that all hosts share (sources seen everywhere).
pub const HEAVY: usize = 10;
/// Keys each host holds alone.
pub const OWN: usize = 10;
/// A heavy key's cluster budget, packets/s.
pub const RATE: f64 = 1000.0;
/// A heavy key's demand over the cluster, in budgets.
pub const FLOOD: f64 = 4.0;
/// An own key's demand at its host, packets/s (under its budget: its host alone holds it).
pub const OWN_PPS: f64 = 20.0;
/// The sync interval, ms (the default).
pub const SYNC_MS: u64 = 100;
/// Seconds measured per N.
pub const MEASURE: f64 = 5.0;
const RULE: &str = "bench";

/// What one N measured.
#[derive(Debug)]
pub struct Scale {
    /// Hosts.
    pub hosts: usize,
    /// Seconds measured.
    pub secs: f64,
    /// Scripts Redis ran per host per second (`EVALSHA` and `EVAL` calls).
    pub cmds_per_host: f64,
    /// Bytes Redis read (sent to it) and wrote (sent by it) per host per second.
    pub bytes_in_per_host: f64,
    /// See [`Scale::bytes_in_per_host`].
    pub bytes_out_per_host: f64,
    /// Redis CPU, cores, summed over the masters.
    pub redis_cpu: f64,
    /// This process's CPU (the simulated hosts' client side), cores.
    pub client_cpu: f64,
    /// Round trips of the rounds that succeeded, ms: p50, p99.
    pub rtt_p50_ms: f64,
    /// See [`Scale::rtt_p50_ms`].
    pub rtt_p99_ms: f64,
    /// Rounds begun per host per second (the agent's aim: `1000 / SYNC_MS`).
    pub rounds_per_host: f64,
    /// Rounds that failed (timeouts, errors, connecting) per host per second.
    pub errors_per_host: f64,
    /// Admitted / budget over the heavy keys (see the module's doc).
    pub admitted: f64,
    /// Admitted / budget at the shares of the rounds that reached the store only (each host's
    /// mean over them; a host with none at its whole rate): what the shares divide, without the
    /// failed rounds' fail open.
    pub admitted_ok: f64,
    /// The most hosts a host saw holding a heavy key (itself and the fields returned).
    pub holders_seen_max: u32,
    /// The mean of what the hosts saw, at their last round.
    pub holders_seen_mean: f64,
    /// The load average when the window ended.
    pub loadavg: String,
}

/// Runs the part for each N and adds its figures to `report`; returns what each N measured, for
/// the chart ([`crate::chart::redis_scale`]).
pub fn run(report: &mut Report, opts: &Options) -> Result<Vec<Scale>> {
    let sizes: &[usize] = if opts.quick {
        &[10, 100]
    } else {
        &[10, 100, 500, 1000, 2000]
    };
    raise_fd_limit()?;
    announce(&format!("redis: starting a {MASTERS}-master Redis Cluster"));
    let cluster = LocalRedisCluster::start(MASTERS, "bench")?;
    let rt = tokio::runtime::Runtime::new()?;
    let mut runs = Vec::new();
    for &n in sizes {
        check_interrupted()?;
        announce(&format!("redis: {n} simulated hosts"));
        #[expect(clippy::cast_precision_loss, reason = "host counts")]
        let warmup = 2.0 + n as f64 * 0.002;
        let s = measure(&rt, &cluster, n, warmup, MEASURE).with_context(|| format!("{n} hosts"))?;
        eprintln!(
            "==> bench: redis, {n} hosts: admitted/budget {:.3} ({:.3} at the shares of rounds \
             that reached the store), {:.0} scripts/s and {:.0} B/s \
             in, {:.0} B/s out per host, Redis CPU {:.2} cores, rtt p50 {:.1} ms p99 {:.1} ms, \
             {:.2} rounds/s and {:.2} errors/s per host, load {}",
            s.admitted,
            s.admitted_ok,
            s.cmds_per_host,
            s.bytes_in_per_host,
            s.bytes_out_per_host,
            s.redis_cpu,
            s.rtt_p50_ms,
            s.rtt_p99_ms,
            s.rounds_per_host,
            s.errors_per_host,
            s.loadavg
        );
        runs.push(s);
    }
    drop(rt);
    drop(cluster);
    for s in &runs {
        add_figures(report, s);
    }
    Ok(runs)
}

fn add_figures(report: &mut Report, s: &Scale) {
    let n = s.hosts;
    let detail = json!({
        "seconds": s.secs,
        "rounds_per_host_s": s.rounds_per_host,
        "errors_per_host_s": s.errors_per_host,
        "client_cpu_cores": s.client_cpu,
        "admitted_at_the_shares_of_rounds_that_reached_the_store": s.admitted_ok,
        "holders_seen_max": s.holders_seen_max,
        "holders_seen_mean": s.holders_seen_mean,
        "loadavg": s.loadavg,
        "keys_per_host": HEAVY + OWN,
        "sync_interval_ms": SYNC_MS,
    });
    let base = |what: &str| (n != 10).then(|| format!("redis.n10.{what}"));
    for (what, label, unit, value) in [
        (
            "admitted",
            "admitted / budget (10 shared keys, 95/5)",
            "x",
            s.admitted,
        ),
        (
            "cmds_per_host",
            "scripts Redis ran per host",
            "/s",
            s.cmds_per_host,
        ),
        (
            "bytes_in_per_host",
            "bytes sent to Redis per host",
            "B/s",
            s.bytes_in_per_host,
        ),
        (
            "bytes_out_per_host",
            "bytes Redis sent per host",
            "B/s",
            s.bytes_out_per_host,
        ),
        (
            "redis_cpu",
            "Redis CPU, 3 masters together",
            "cores",
            s.redis_cpu,
        ),
        ("rtt_p50", "round trip of a round, p50", "ms", s.rtt_p50_ms),
        ("rtt_p99", "round trip of a round, p99", "ms", s.rtt_p99_ms),
    ] {
        report.add(Figure {
            key: format!("redis.n{n}.{what}"),
            section: "redis",
            label: format!("{n} hosts: {label}"),
            unit,
            runs: vec![value],
            baseline: base(what),
            detail: detail.clone(),
        });
    }
}

/// One simulated host: its store client, the keys it writes, its demand for the heavy ones.
struct Host {
    store: RedisStore,
    entries: Vec<Entry>,
    names: Vec<KeyName>,
    /// This host's demand for each heavy key (the first [`HEAVY`] entries), packets/s.
    heavy_demand: f64,
    /// When its first round runs, after the start.
    first: Duration,
}

/// What one host saw: its rounds (when, and the heavy keys' admitted pps at the shares set),
/// round trips and failures inside the window, and the holders it saw at its last round.
#[derive(Default)]
struct Seen {
    rounds: Vec<(f64, f64)>,
    /// The heavy keys' admitted pps at the shares of the counted rounds that reached the store.
    ok: Vec<f64>,
    rtt_ms: Vec<f64>,
    begun: u64,
    failed: u64,
    holders: u32,
}

/// Heavy key `j`'s address, host `i`'s node id, host `i`'s own key `k`'s address.
fn heavy_addr(j: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 18, 0, u8::try_from(j + 1).unwrap_or(0)))
}

fn own_addr(i: usize, k: usize) -> IpAddr {
    let x = u32::try_from(i * OWN + k).unwrap_or(0);
    IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 0)) + x))
}

/// This host's demand for a heavy key when `n` hosts hold it, 5% of them (at least one) taking
/// 95% of it.
#[must_use]
pub fn heavy_demand(i: usize, n: usize) -> f64 {
    let hot = n.div_ceil(20).max(1);
    let total = FLOOD * RATE;
    #[expect(clippy::cast_precision_loss, reason = "host counts")]
    if n == 1 {
        total
    } else if i < hot {
        0.95 * total / hot as f64
    } else {
        0.05 * total / (n - hot) as f64
    }
}

fn hosts(cluster: &LocalRedisCluster, n: usize) -> Result<Vec<Host>> {
    let config = RedisConfig {
        urls: cluster.urls(),
        user: None,
        password_file: None,
        ca_file: None,
        connect_timeout_ms: DEFAULT_REDIS_CONNECT_TIMEOUT_MS,
        command_timeout_ms: DEFAULT_REDIS_COMMAND_TIMEOUT_MS,
    };
    let cluster_id = format!("bench-n{n}");
    (0..n)
        .map(|i| {
            let node = format!(
                "bench-{i}/198.18.{}.{}",
                1 + i / 256,
                i % 256 // a node id ends with its address
            );
            let store = RedisStore::new(&config, &cluster_id, node, 1).map_err(|e| anyhow!(e))?;
            let mut names: Vec<KeyName> = (0..HEAVY)
                .map(|j| KeyName {
                    rule: RULE.into(),
                    limit: 0,
                    addr: heavy_addr(j),
                })
                .collect();
            names.extend((0..OWN).map(|k| KeyName {
                rule: RULE.into(),
                limit: 0,
                addr: own_addr(i, k),
            }));
            let d = heavy_demand(i, n);
            let entries = names
                .iter()
                .enumerate()
                .map(|(j, k)| Entry {
                    key: key_name(&cluster_id, &k.rule, k.limit, k.addr),
                    demand: if j < HEAVY { d } else { OWN_PPS },
                })
                .collect();
            #[expect(clippy::cast_possible_truncation, reason = "i < n, a few thousand")]
            let first = Duration::from_secs(1) * i as u32 / u32::try_from(n).unwrap_or(1);
            Ok(Host {
                store,
                entries,
                names,
                heavy_demand: d,
                first,
            })
        })
        .collect()
}

/// The heavy keys' limit: [`RATE`] pps.
fn limits() -> ClusterLimits {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a rate"
    )]
    let pkt_interval_ns = (1e9 / RATE) as u64;
    ClusterLimits::default().with(
        RULE,
        0,
        Limits {
            pkt_interval_ns,
            pkt_tolerance_ns: 0,
            byte_interval_fp: 0,
            byte_tolerance_ns: 0,
        },
    )
}

/// What a bucket admits of `demand` pps at share `s` of [`RATE`]: its refill, `1e9 / cost` pps
/// for the cost the program charges at the share's word, or the demand if less.
fn admitted_at(s: f64, demand: f64) -> f64 {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a rate"
    )]
    let cost = (1e9 / RATE) as u64;
    let word = u64::from(shares::share_word(s));
    #[expect(clippy::cast_precision_loss, reason = "ns")]
    let refill = 1e9 / ratelimit_common::share_cost(cost, word) as f64;
    demand.min(refill)
}

/// One host's rounds from `start` until `end` (seconds after `start`); those begun in
/// `[from, end)` are counted.
async fn host_loop(mut h: Host, start: Instant, from: f64, end: f64) -> Seen {
    let timing = Timing::new(SYNC_MS);
    let stale_ms = timing.stale_ns() / 1_000_000;
    let ttl_ms = stale_ms.saturating_mul(2);
    let limits = limits();
    let ns = |t: Instant| u64::try_from(t.duration_since(start).as_nanos()).unwrap_or(u64::MAX);
    let mut readings: HashMap<KeyName, Reading> = HashMap::new();
    let mut seen = Seen::default();
    tokio::time::sleep(h.first).await;
    let mut tick = tokio::time::interval(timing.interval());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let began = start.elapsed().as_secs_f64();
        if began >= end {
            return seen;
        }
        let counted = began >= from;
        let exchanged = h.store.exchange(&h.entries, stale_ms, ttl_ms).await;
        let now = ns(Instant::now());
        let reached = exchanged.is_ok();
        match exchanged {
            Ok(x) => {
                readings.clear();
                for (name, fields) in h.names.iter().zip(x.fields) {
                    readings.insert(
                        name.clone(),
                        Reading {
                            fields,
                            read_ns: now,
                        },
                    );
                }
                if counted {
                    seen.rtt_ms.push(x.rtt_ms);
                }
            }
            Err(_) if counted => seen.failed += 1,
            Err(_) => {}
        }
        seen.begun += u64::from(counted);
        let (round, _) = round_of(&readings, &limits, now, stale_ms);
        let mut admitted = 0.0;
        for name in &h.names[..HEAVY] {
            let hosts = round.hosts_holding(name);
            seen.holders = seen.holders.max(hosts);
            let s = shares::share(
                h.heavy_demand,
                round.peer_demand(name),
                1.0,
                Some(RATE),
                f64::from(hosts),
            );
            admitted += admitted_at(s, h.heavy_demand);
        }
        if reached && counted {
            seen.ok.push(admitted);
        }
        #[expect(clippy::cast_precision_loss, reason = "ns")]
        seen.rounds.push((now as f64 / 1e9, admitted));
    }
}

/// What host `seen` admitted of the heavy keys over `[from, to]` (seconds), packets: each
/// round's figure until the next round or until its shares lapse (`lag` s after it), the whole
/// rate (fail open) otherwise and before its first round.
fn admitted_over(rounds: &[(f64, f64)], from: f64, to: f64, lag: f64, whole: f64) -> f64 {
    let mut total = 0.0;
    let mut t = from;
    // Before the first round that starts after `from`, the last one before it holds.
    let mut current: Option<(f64, f64)> = None;
    for &(at, admitted) in rounds {
        if at <= from {
            current = Some((at, admitted));
            continue;
        }
        let until = at.min(to);
        total += segment(current, t, until, lag, whole);
        t = until;
        current = Some((at, admitted));
        if at >= to {
            break;
        }
    }
    total + segment(current, t, to, lag, whole)
}

/// Packets admitted over `[a, b]` under `round` (when, pps at its shares): its pps until `lag`
/// after it, then `whole`.
fn segment(round: Option<(f64, f64)>, a: f64, b: f64, lag: f64, whole: f64) -> f64 {
    if b <= a {
        return 0.0;
    }
    match round {
        None => whole * (b - a),
        Some((at, pps)) => {
            let held = (at + lag).clamp(a, b);
            pps * (held - a) + whole * (b - held)
        }
    }
}

/// Redis's counters of one master: (scripts run, bytes read, bytes written, CPU seconds).
fn counters(info: &str) -> Result<(u64, u64, u64, f64)> {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .ok_or_else(|| anyhow!("INFO has no {name}"))
    };
    let calls = |cmd: &str| -> u64 {
        field(&format!("cmdstat_{cmd}"))
            .ok()
            .and_then(|v| v.split(',').find_map(|p| p.strip_prefix("calls=")))
            .and_then(|c| c.parse().ok())
            .unwrap_or(0)
    };
    Ok((
        calls("evalsha") + calls("eval"),
        field("total_net_input_bytes")?.parse()?,
        field("total_net_output_bytes")?.parse()?,
        field("used_cpu_sys")?.parse::<f64>()? + field("used_cpu_user")?.parse::<f64>()?,
    ))
}

/// The masters' counters summed, and this process's CPU time.
fn snapshot(cluster: &LocalRedisCluster) -> Result<((u64, u64, u64, f64), Duration)> {
    let mut sum = (0, 0, 0, 0.0);
    for i in 0..cluster.masters() {
        let c = counters(&cluster.cli(i, &["INFO", "all"])?)?;
        sum = (sum.0 + c.0, sum.1 + c.1, sum.2 + c.2, sum.3 + c.3);
    }
    let me = libc::pid_t::try_from(std::process::id())?;
    Ok((sum, cpu_time(me)?))
}

/// Runs `n` hosts for `warmup` then `secs` seconds on `rt` against `cluster`, and measures the
/// second part.
// Stays whole: the hosts started, the window's two snapshots, the hosts' results summed.
pub fn measure(
    rt: &tokio::runtime::Runtime,
    cluster: &LocalRedisCluster,
    n: usize,
    warmup: f64,
    secs: f64,
) -> Result<Scale> {
    if n == 0 {
        bail!("no hosts to simulate");
    }
    let hosts = hosts(cluster, n)?;
    let start = Instant::now();
    let end = warmup + secs;
    let handles: Vec<_> = hosts
        .into_iter()
        .map(|h| rt.spawn(host_loop(h, start, warmup, end)))
        .collect();
    std::thread::sleep(Duration::from_secs_f64(warmup).saturating_sub(start.elapsed()));
    let (before, cpu0) = snapshot(cluster)?;
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(end).saturating_sub(start.elapsed()));
    let (after, cpu1) = snapshot(cluster)?;
    let window = t0.elapsed().as_secs_f64();
    let load = loadavg();
    let seen: Vec<Seen> = rt.block_on(async {
        let mut out = Vec::new();
        for h in handles {
            out.push(h.await?);
        }
        Ok::<_, tokio::task::JoinError>(out)
    })?;
    #[expect(clippy::cast_precision_loss, reason = "counts")]
    let (nf, per) = (n as f64, |d: u64| d as f64 / window / n as f64);
    let timing = Timing::new(SYNC_MS);
    #[expect(clippy::cast_precision_loss, reason = "ns")]
    let lag = timing.lag_ns() as f64 / 1e9;
    let mut admitted = 0.0;
    let mut admitted_ok = 0.0;
    let mut rtt: Vec<f64> = Vec::new();
    let (mut begun, mut failed) = (0, 0);
    for (i, s) in seen.iter().enumerate() {
        #[expect(clippy::cast_precision_loss, reason = "a count")]
        let whole = HEAVY as f64 * heavy_demand(i, n).min(RATE);
        admitted += admitted_over(&s.rounds, warmup, end, lag, whole);
        #[expect(clippy::cast_precision_loss, reason = "a count")]
        let ok = s.ok.iter().sum::<f64>() / s.ok.len() as f64;
        admitted_ok += if s.ok.is_empty() { whole } else { ok };
        rtt.extend(&s.rtt_ms);
        begun += s.begun;
        failed += s.failed;
    }
    rtt.sort_by(f64::total_cmp);
    let pct = |p: f64| -> f64 {
        if rtt.is_empty() {
            return f64::NAN;
        }
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "an index"
        )]
        let i = ((rtt.len() - 1) as f64 * p).round() as usize;
        rtt[i]
    };
    #[expect(clippy::cast_precision_loss, reason = "a count")]
    let budget = HEAVY as f64 * RATE * secs;
    Ok(Scale {
        hosts: n,
        secs: window,
        cmds_per_host: per(after.0.saturating_sub(before.0)),
        bytes_in_per_host: per(after.1.saturating_sub(before.1)),
        bytes_out_per_host: per(after.2.saturating_sub(before.2)),
        redis_cpu: (after.3 - before.3) / window,
        client_cpu: cpu1.saturating_sub(cpu0).as_secs_f64() / window,
        rtt_p50_ms: median(&rtt),
        rtt_p99_ms: pct(0.99),
        rounds_per_host: per(begun),
        errors_per_host: per(failed),
        admitted: admitted / budget,
        #[expect(clippy::cast_precision_loss, reason = "a count")]
        admitted_ok: admitted_ok / (HEAVY as f64 * RATE),
        holders_seen_max: seen.iter().map(|s| s.holders).max().unwrap_or(0),
        holders_seen_mean: seen.iter().map(|s| f64::from(s.holders)).sum::<f64>() / nf,
        loadavg: load,
    })
}

/// Raises this process's open-file limit to its hard limit: every simulated host holds a
/// connection to each master (and one more while it connects).
fn raise_fd_limit() -> Result<()> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid pointer to an rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut lim) } != 0 {
        return Err(std::io::Error::last_os_error()).context("getrlimit(RLIMIT_NOFILE)");
    }
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: a valid pointer to an rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim) } != 0 {
        return Err(std::io::Error::last_os_error()).context("setrlimit(RLIMIT_NOFILE)");
    }
    Ok(())
}

#[cfg(test)]
mod tests;
