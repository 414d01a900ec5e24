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

/// The table's figures, the verdicts and a summary for the JSON.
#[expect(
    clippy::too_many_lines,
    clippy::cast_precision_loss,
    reason = "one verdict after the other; counts as f64"
)]
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
            "A new source's first packet passes without a bucket (a slot of `RL_FIRST_PACKETS` \
             holds when its bucket would be full again); its next one makes the bucket if it \
             comes before then, or if every slot of its line was held: 1 frame in {:.1} made \
             one here.",
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
