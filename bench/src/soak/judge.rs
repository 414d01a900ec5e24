//! The soak's figures and verdicts from its samples and final reads: traffic, the bucket store
//! (full, evictions adding up, few lost), the agent (memory without a trend, CPU, calls).

use std::time::Duration;

use serde_json::{json, Value};

use super::{Final, Sample, FULL_SHARE, LOST_SHARE, RANDOM_BITS, SETTLE};
use crate::report::{Figure, Report, Target};

/// Evictions the program counted since the start (`evicted_full + evicted_lost`), given the two
/// counters at the start and now.
#[expect(
    clippy::cast_possible_wrap,
    reason = "bucket counts are far below 2^63"
)]
pub(super) fn evictions(at_start: (u64, u64), full: u64, lost: u64) -> i64 {
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

/// Least-squares slope of `(x, y)`.
pub(super) fn slope(points: &[(f64, f64)]) -> Option<f64> {
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

/// The table's figures, the verdicts and a summary for the JSON: the figures section by section
/// (traffic, bucket store, agent), then the verdicts in their numbered order (1. the flood is
/// larger than the store, 2. the store evicts and its counts add up, 3. the polite source, 4.
/// memory, 5. the agent stayed up), the notes and the summary.
pub(super) fn judge(
    samples: &[Sample],
    fin: &Final,
    duration: Duration,
    machine: Value,
) -> (Report, Value) {
    let mut report = Report {
        machine,
        ..Report::default()
    };
    let capacity = fin.capacity.max(1);
    let full_at = full_at(samples, capacity);
    let rates = Rates::of(samples, full_at);
    traffic_figures(&mut report, samples);
    store_figures(&mut report, samples, rates);
    agent_figures(&mut report, samples);

    // 1. The flood is larger than the bucket map.
    let distinct = distinct_sources(fin.frames);
    let mut targets = vec![flood_target(fin, capacity, distinct)];
    // 2. Evictions counted by the program, store at capacity, never above it.
    let counts = StoreCounts::of(samples, fin, full_at);
    targets.push(evictions_target(samples, fin, capacity, full_at, &counts));
    targets.push(lost_target(fin, counts.evicted));
    targets.push(capacity_target(samples, fin, capacity, counts.max_tracked));
    // 3. The polite source.
    targets.push(polite_target(samples, fin));
    // 4. Memory, once the store is full.
    let settle = memory_from(duration, full_at);
    let memory = memory(samples, fin, settle);
    targets.push(memory_target(&memory));
    // 5. The agent stayed up and answered.
    targets.push(agent_target(samples, fin));
    report.targets = targets;
    report.notes = notes(fin);
    let summary = summary(fin, distinct, &counts, full_at, settle, &memory);
    (report, summary)
}

/// When the store first counted as full (the first sample tracking [`FULL_SHARE`] of
/// `capacity`), if it ever did: only from then on must it evict, so eviction rates and memory
/// are judged from there.
#[expect(clippy::cast_precision_loss, reason = "bucket counts as f64")]
fn full_at(samples: &[Sample], capacity: u64) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.tracked as f64 >= FULL_SHARE * capacity as f64)
        .map(|s| s.t)
}

/// Per-second rates over each interval between two samples: buckets created over the whole
/// soak, and buckets evicted (all, and those in debt) over the intervals that start with the
/// store full, as before then nothing needs evicting.
struct Rates {
    created: Vec<f64>,
    evicted: Vec<f64>,
    lost: Vec<f64>,
}

impl Rates {
    /// The rates between `samples`, eviction's from `full_at` on.
    #[expect(clippy::cast_precision_loss, reason = "counts as f64")]
    fn of(samples: &[Sample], full_at: Option<f64>) -> Self {
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
        Self {
            created: created_ps,
            evicted: evicted_ps,
            lost: lost_ps,
        }
    }
}

/// Adds the soak's figure `soak.{key}` to `report`, a row of `section`: its runs are the
/// samples (or, for a rate, the intervals), with no baseline.
fn figure(
    report: &mut Report,
    key: &str,
    section: &'static str,
    label: &str,
    unit: &'static str,
    runs: Vec<f64>,
) {
    report.add(Figure {
        key: format!("soak.{key}"),
        section,
        label: label.into(),
        unit,
        runs,
        baseline: None,
        detail: Value::Null,
    });
}

/// `f` of every sample, in order: the runs of a figure.
fn column(samples: &[Sample], f: impl Fn(&Sample) -> f64) -> Vec<f64> {
    samples.iter().map(f).collect()
}

/// The traffic, per interval: what the generator sent and what the receiving veth handled, so
/// that the table shows the flood the verdicts were judged under.
fn traffic_figures(report: &mut Report, samples: &[Sample]) {
    figure(
        report,
        "gen_mpps",
        SECTION_TRAFFIC,
        "generator: random-source frames sent",
        "Mpps",
        column(samples, |s| s.gen_mpps),
    );
    figure(
        report,
        "rx_mpps",
        SECTION_TRAFFIC,
        "receiving veth: frames handled (rx_packets)",
        "Mpps",
        column(samples, |s| s.rx_mpps),
    );
}

/// The bucket store: buckets tracked at each sample, and the rates of creation and eviction
/// (all, and of buckets in debt) from [`Rates`]: the store fills, then evicts as fast as the
/// flood creates.
#[expect(clippy::cast_precision_loss, reason = "bucket counts as f64")]
fn store_figures(report: &mut Report, samples: &[Sample], rates: Rates) {
    figure(
        report,
        "tracked",
        SECTION_MAP,
        "buckets tracked",
        "buckets",
        column(samples, |s| s.tracked as f64),
    );
    figure(
        report,
        "created_per_sec",
        SECTION_MAP,
        "buckets created (new_buckets), per second",
        "1/s",
        rates.created,
    );
    figure(
        report,
        "evicted_per_sec",
        SECTION_MAP,
        "buckets evicted (evicted_full + evicted_lost) per second, full",
        "1/s",
        rates.evicted,
    );
    figure(
        report,
        "evicted_lost_per_sec",
        SECTION_MAP,
        "of which in debt (evicted_lost) per second, full",
        "1/s",
        rates.lost,
    );
}

/// The agent at each sample: its resident memory, its CPU, and how long each operator call
/// took, so that a slow or growing agent shows beside the verdicts.
#[expect(clippy::cast_precision_loss, reason = "KiB to MiB")]
fn agent_figures(report: &mut Report, samples: &[Sample]) {
    figure(
        report,
        "rss",
        SECTION_AGENT,
        "agent resident memory (VmRSS)",
        "MiB",
        column(samples, |s| s.rss_kib as f64 / 1024.0),
    );
    figure(
        report,
        "cpu",
        SECTION_AGENT,
        "agent CPU, operator calls included",
        "% core",
        column(samples, |s| s.cpu_pct),
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
        figure(report, key, SECTION_AGENT, label, "ms", column(samples, f));
    }
}

/// The distinct sources expected among `frames` frames, each with [`RANDOM_BITS`] random source
/// bits: `2^n x (1 - e^(-frames/2^n))`, the buckets the flood asks the store for.
#[expect(clippy::cast_precision_loss, reason = "a frame count as f64")]
fn distinct_sources(frames: u64) -> f64 {
    let space = f64::from(1u32 << RANDOM_BITS);
    space * (1.0 - (-(frames as f64) / space).exp())
}

/// Verdict 1: the flood offers more sources than the store can track (`distinct` expected, and
/// buckets actually created): without that the soak would never evict.
#[expect(clippy::cast_precision_loss, reason = "counts as f64")]
fn flood_target(fin: &Final, capacity: u64, distinct: f64) -> Target {
    Target {
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
    }
}

/// The store's counts that the eviction verdicts and the summary share.
#[derive(Clone, Copy)]
struct StoreCounts {
    /// Evictions the program counted during the soak (`evicted_full + evicted_lost`).
    evicted: i64,
    /// Buckets that left the store by the counts alone (see [`departed`]).
    left: i64,
    /// The largest tracked count read (status, stats and metrics at each sample, the end).
    max_tracked: u64,
    /// Evictions since the first sample with the store full, if it filled.
    evicted_since_full: Option<i64>,
}

impl StoreCounts {
    /// The counts, from the final reads and the samples (`full_at`: see [`full_at`]).
    fn of(samples: &[Sample], fin: &Final, full_at: Option<f64>) -> Self {
        let evicted = (fin.evicted_full + fin.evicted_lost) as i64;
        let left = departed(fin.created, fin.tracked0, fin.tracked);
        let max_tracked = samples
            .iter()
            .map(|s| s.tracked.max(s.status_tracked).max(s.metrics_tracked))
            .max()
            .unwrap_or(0)
            .max(fin.tracked);
        let evicted_since_full = full_at.and_then(|t| {
            let s = samples.iter().find(|s| s.t >= t)?;
            Some(evicted - s.evicted)
        });
        Self {
            evicted,
            left,
            max_tracked,
            evicted_since_full,
        }
    }
}

/// Verdict 2, first of three: the program counts its evictions. The store filled and evicted,
/// and at rest its counters equal the buckets that left by the counts (created minus the growth
/// of tracked), as no rule is removed. The metrics' counters of the last sample are shown beside
/// stats'.
#[expect(clippy::cast_precision_loss, reason = "an eviction count as f64")]
fn evictions_target(
    samples: &[Sample],
    fin: &Final,
    capacity: u64,
    full_at: Option<f64>,
    counts: &StoreCounts,
) -> Target {
    let StoreCounts {
        evicted,
        left,
        evicted_since_full,
        ..
    } = *counts;
    let evicting_secs = full_at.map(|t| fin.traffic_secs - t);
    let last = samples.last();
    let metrics_agree = last.is_some_and(|s| {
        s.metrics_evicted_full == s.evicted_full && s.metrics_evicted_lost == s.evicted_lost
    });
    Target {
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
    }
}

/// Verdict 2, second of three: one-packet sources' buckets have refilled long before a new
/// source evicts them, so at most [`LOST_SHARE`] of the `evicted` buckets may have been in debt
/// (judged only if any were).
#[expect(clippy::cast_precision_loss, reason = "eviction counts as f64")]
fn lost_target(fin: &Final, evicted: i64) -> Target {
    let lost_share = fin.evicted_lost as f64 / (evicted.max(1) as f64);
    Target {
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
    }
}

/// Verdict 2, last of three: the kernel side keeps the store within its capacity, no sample's
/// tracked count (by status, stats or metrics) above it; the failed inserts and the sources
/// without a bucket are shown beside.
fn capacity_target(samples: &[Sample], fin: &Final, capacity: u64, max_tracked: u64) -> Target {
    let over = samples
        .iter()
        .filter(|s| s.tracked.max(s.status_tracked).max(s.metrics_tracked) > capacity)
        .count();
    Target {
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
    }
}

/// Verdict 3: the polite source (200 pps, well under its limit) is never dropped, however many
/// buckets the flood evicts: all it sent arrived, and its bucket (at the end and at every sample)
/// dropped nothing. Whether that bucket lived through the whole soak is told by its age.
fn polite_target(samples: &[Sample], fin: &Final) -> Target {
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
    Target {
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
    }
}

/// Seconds into the soak from which memory is judged: the end of the first minute ([`SETTLE`],
/// half the soak in shorter ones), and not before the store is full, as until then the map
/// walks behind the operator paths grow with it.
fn memory_from(duration: Duration, full_at: Option<f64>) -> f64 {
    SETTLE
        .as_secs_f64()
        .min(duration.as_secs_f64() / 2.0)
        .max(full_at.unwrap_or(0.0))
}

/// The memory verdict's findings, and the trends the summary keeps.
struct Memory {
    /// The verdict (`None`: too few samples to judge).
    met: Option<bool>,
    evidence: String,
    /// Least-squares slope of the floor of VmRSS at rest, KiB/min (NaN when not fitted).
    floor_slope: f64,
    /// Least-squares slope of VmRSS at every sample, KiB/min (NaN when not judged).
    rss_slope: f64,
}

/// Verdict 4: memory, judged on the samples from `settle` on (see [`memory_from`]) when there are
/// at least four of them (see [`memory_band`]).
fn memory(samples: &[Sample], fin: &Final, settle: f64) -> Memory {
    let window: Vec<&Sample> = samples.iter().filter(|s| s.t >= settle).collect();
    if window.len() >= 4 {
        memory_band(&window, fin)
    } else {
        Memory {
            met: None,
            evidence: format!(
                "too few samples from {settle:.0} s on (after the first minute, map full)"
            ),
            floor_slope: f64::NAN,
            rss_slope: f64::NAN,
        }
    }
}

/// VmRSS at rest moves in a band over `window`: the allocator keeps some of the buffers of the
/// map walks behind `status`, `stats`, `top` and the metrics, and trims them now and then. A
/// leak raises the band's floor; a growing buffer raises its ceiling. So the band of the second
/// half must stay within max(2 MiB, 5%) of the first half's, floor and ceiling, and so must the
/// floor's trend over the window ([`rss_floor`]).
#[expect(clippy::cast_precision_loss, reason = "KiB counts as f64")]
fn memory_band(window: &[&Sample], fin: &Final) -> Memory {
    let mib = |k: f64| k / 1024.0;
    let (first, last) = window.split_at(window.len() / 2);
    let lo = |h: &[&Sample]| h.iter().map(|s| s.rss_min_kib).min().unwrap_or(0) as f64;
    let hi = |h: &[&Sample]| h.iter().map(|s| s.rss_max_kib).max().unwrap_or(0) as f64;
    let (lo1, hi1, lo2, hi2) = (lo(first), hi(first), lo(last), hi(last));
    let tol = (2048.0f64).max(0.05 * lo1);
    let (t0, t1) = (window[0].t, window[window.len() - 1].t);
    let span = t1 - t0;
    // Per minute, or per sample in runs shorter than four minutes.
    let group = if span >= 240.0 { 60.0 } else { 1e-9 };
    let floor = rss_floor(window, t0, group);
    let at_sample: Vec<(f64, f64)> = window.iter().map(|s| (s.t, s.rss_kib as f64)).collect();
    let k_floor = slope(&floor);
    let k_rss = slope(&at_sample).unwrap_or(f64::NAN);
    let rising = k_floor.is_some_and(|k| k * span > tol);
    let met = lo2 <= lo1 + tol && hi2 <= hi1 + tol && !rising;
    Memory {
        met: Some(met),
        evidence: format!(
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
            if group > 1.0 {
                "per-minute"
            } else {
                "per-sample"
            },
            k_floor.map_or_else(|| "-".into(), |k| format!("{:+.1} KiB/min", k * 60.0)),
            k_floor.map_or_else(|| "-".into(), |k| format!("{:+.0} KiB", k * span)),
            k_rss * 60.0,
            mib(window[0].rss_kib as f64),
            mib(window[window.len() - 1].rss_kib as f64),
            mib(fin.hwm_kib as f64),
        ),
        floor_slope: k_floor.map_or(f64::NAN, |k| k * 60.0),
        rss_slope: k_rss * 60.0,
    }
}

/// The floor of VmRSS at rest over `window`: the lowest reading of each `group` seconds from
/// `t0`, at the group's start. Its trend is what a leak raises, which the band's swings would
/// hide in VmRSS at each sample.
#[expect(clippy::cast_precision_loss, reason = "KiB counts as f64")]
fn rss_floor(window: &[&Sample], t0: f64, group: f64) -> Vec<(f64, f64)> {
    let mut floor: Vec<(f64, f64)> = Vec::new();
    for s in window {
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
    floor
}

/// The memory verdict as a target: the band of VmRSS at rest does not rise once the store is
/// full.
fn memory_target(memory: &Memory) -> Target {
    Target {
        goal:
            "agent memory is flat once the store is full: the band of VmRSS at rest neither rises \
               (floor, ceiling, floor's trend within max(2 MiB, 5%))"
                .into(),
        met: memory.met,
        evidence: memory.evidence.clone(),
    }
}

/// Verdict 5: the agent stayed up and answered: it exited only when stopped (status 0 after
/// SIGTERM), no operator call failed, and every reload asked was counted as done, none failed.
fn agent_target(samples: &[Sample], fin: &Final) -> Target {
    let reloads_ok = fin.reloads_failed == 0 && fin.reloads_ok >= fin.reloads_done;
    Target {
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
    }
}

/// The notes under the table: how the figures were sampled and where each side ran, what
/// "evicted" counts, and how often a frame of the flood made a bucket.
#[expect(clippy::cast_precision_loss, reason = "counts as f64")]
fn notes(fin: &Final) -> Vec<String> {
    vec![
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
            "A new source's first packet passes without a bucket (a slot of its line of \
             `RL_BUCKET_TAGS` holds when its bucket would be full again); its next one makes \
             the bucket if it comes before then, or if every slot of its line was held: 1 frame \
             in {:.1} made one here.",
            fin.frames as f64 / fin.created.max(1) as f64
        ),
    ]
}

/// The JSON summary: the final reads and what the verdicts found (expected distinct sources,
/// the store's counts, when it filled, memory's window and trends), so a run can be compared
/// without its table.
fn summary(
    fin: &Final,
    distinct: f64,
    counts: &StoreCounts,
    full_at: Option<f64>,
    settle: f64,
    memory: &Memory,
) -> Value {
    let StoreCounts {
        evicted,
        left,
        max_tracked,
        evicted_since_full,
    } = *counts;
    json!({
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
        "rss_floor_slope_kib_per_min": if memory.floor_slope.is_finite() { json!(memory.floor_slope) } else { Value::Null },
        "rss_slope_kib_per_min": if memory.rss_slope.is_finite() { json!(memory.rss_slope) } else { Value::Null },
        "vm_hwm_kib": fin.hwm_kib,
        "reloads": { "asked": fin.reloads_done, "ok": fin.reloads_ok, "failed": fin.reloads_failed },
        "agent_exit": fin.agent_exit,
        "failed_calls": fin.errors,
        "agent_log_warnings": fin.log_warnings,
    })
}
