//! The benchmark and soak runner behind `cargo xtask bench` and `cargo xtask soak`. xtask sets up
//! the toolchain, builds the agent and this crate in release mode, and starts the binary
//! (`src/main.rs`, `ratelimit-bench`), which parses the command line and calls [`run`] or
//! [`soak::run`]; the agent it measures is the `ratelimit` that `RATELIMIT_BIN` names.
//!
//! # Layout
//! How a figure is made: a part loads the project's XDP object and the reference programs
//! ([`refs`], [`progs`]: hand-assembled floors, probes and drivers), runs frames through them
//! (BPF_PROG_TEST_RUN, or the live-frames [`generator`] over a veth pair of the test bed), takes the
//! median of several runs into a [`report::Report`], and [`run`] prints the report as a table, judges
//! it against the targets and writes it as JSON (plus a [`chart`] of the bucket store). The parts,
//! every ratio against a baseline measured in the same run:
//! - [`kernel`]: in-kernel cost per packet through BPF_PROG_TEST_RUN, the limiter against an
//!   XDP_PASS floor, hot and with 1k to 1M tracked sources; with it [`f1`], one dependent read
//!   of a region the size of the bucket store (a pointer chase) against one independent read;
//!   and [`lru`], the LRU contender (GCRA per source in a kernel `LRU_HASH`, what a user would
//!   pick instead), at the same populations in turns with the limiter, and end to end;
//! - [`rules`]: rule update latency with 10,000 rules, and kernel memory;
//! - [`e2e`]: packets per second over a veth pair from a live-frames generator, for the limiter,
//!   a drop-all floor, an XDP_PASS receiver, nftables, iptables and the LRU contender, with one
//!   hot source and with random sources, and random sources against a per-source + per-rule
//!   (aggregate) limit, the limiter against nftables with the same two levels;
//! - [`agent`]: the real agent's CPU and memory, idle and under a random-source flood;
//! - [`learn`]: what learning (`suggest`) costs: two real agents with a million tracked sources
//!   that send, one learning and one with `learn = false`, their CPU and memory as ratios;
//! - [`cluster`]: 2 to 16 real agents sharing a cluster budget: admitted / budget, time to
//!   converge, gossip bytes and CPU per host against the number of hosts (and two charts);
//! - [`redis`]: 10 to 2,000 simulated hosts in this process on the Redis backend's real client
//!   and scripts against a local 3-master Redis Cluster: per-host scripts and bytes, Redis CPU,
//!   round trips and admitted / budget against the number of hosts (and a chart beside gossip's).
//!
//! `ratelimit-bench soak` runs the [`soak`] instead (`cargo xtask soak`): minutes of a random-source
//! flood larger than the bucket map against the real agent, its operator paths in use.
//!
//! What every part shares, the settings ([`Options`]), progress lines, the interrupt flag and the
//! machine's facts, is in [`session`], at the bottom: the parts use it, and only this file uses the
//! parts. Everything a run makes (namespaces, pins, the agent) is owned by a guard that removes it
//! on drop; Ctrl-C stops the run between measurements ([`session::check_interrupted`]), so the
//! guards run.

mod agent;
mod chart;
mod cluster;
mod e2e;
mod f1;
mod generator;
mod kernel;
mod learn;
mod lru;
mod progs;
mod redis;
mod refs;
mod report;
mod rules;
mod session;
pub mod soak;

use std::path::Path;

use anyhow::{bail, Context as _, Result};
use ratelimit_common::DEFAULT_MAX_BUCKETS;
use serde_json::json;

pub use crate::session::{start, Options};
use crate::{
    report::{Report, Target},
    session::{loadavg, machine},
};

/// The parts of the benchmark (`--only`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    Kernel,
    /// Only the in-kernel cost of rules with 1, 2 and 3 limits and of a flood under an exhausted
    /// per-rule limit (part of `kernel`): for trying a change of the extra limits' path without
    /// the populations.
    Limits,
    /// Only the A/B of the handling of cut packets on whole packets (part of `kernel`).
    Cut,
    /// Only F1, one dependent read of a region the size of the bucket store (a pointer chase),
    /// beside one independent read (part of `kernel`).
    F1,
    /// Only the tracked-source populations (1k to full) with the LRU contender in turns with
    /// them (part of `kernel`): the limiter's store against `LRU_HASH` and `LRU_PERCPU_HASH`.
    Lru,
    Rules,
    E2e,
    Agent,
    /// The learner's CPU and memory with 1M tracked sources, against an agent that does not
    /// learn.
    Learn,
    Cluster,
    /// The Redis backend's scale: simulated hosts against a local 3-master Redis Cluster.
    Redis,
}

/// Runs the benchmark's `parts` (all if empty), prints the table and writes the results to
/// `json` (and the bucket store's chart, `store.svg`, next to it).
pub fn run(opts: &Options, parts: &[Part], json: &Path) -> Result<()> {
    if !ratelimit_testbed::is_root() {
        bail!("the benchmark needs root (network namespaces, XDP, BPF_PROG_TEST_RUN)");
    }
    // The charts (`store.svg`, `cluster.svg`, ...) are drawn next to `json` as each part ends,
    // before the report writes it: on a fresh checkout `target/bench` does not exist yet.
    if let Some(dir) = json.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let want = |p: Part| parts.is_empty() || parts.contains(&p);
    let mut report = Report {
        machine: machine(),
        ..Report::default()
    };
    let started = std::time::Instant::now();
    let mut refs = refs::Refs::load()?;

    if want(Part::Kernel) || want(Part::Rules) {
        kernel_and_rules(&mut report, opts, &refs, want)?;
    } else {
        limits_and_cut(&mut report, opts, &refs, want)?;
    }
    if want(Part::Kernel) || want(Part::F1) {
        f1::run(&mut report, opts, &refs)?;
    }
    if want(Part::E2e) {
        e2e::run(&mut report, opts, &mut refs)?;
    }
    if want(Part::Agent) {
        agent::run(&mut report, opts, &refs)?;
    }
    if want(Part::Learn) {
        learn::run(&mut report, opts)?;
    }
    if want(Part::Cluster) {
        cluster::run(&mut report, opts, json)?;
    }
    if want(Part::Redis) {
        redis::run(&mut report, opts, json)?;
    }
    drop(refs);

    report.machine["loadavg_after"] = json!(loadavg());
    report.machine["bench_seconds"] = json!(started.elapsed().as_secs_f64());
    report.targets = targets(&report);
    report.notes = notes();
    report.notes.extend(overflow_notes(&report));
    print!("{}", report.table());
    report.write_json(json)?;
    eprintln!("==> bench: results written to {}", json.display());
    if report.get("kernel.pop.1k.known").is_some() {
        let svg = json.with_file_name("store.svg");
        chart::store(&report, &svg)?;
        eprintln!("==> bench: chart written to {}", svg.display());
    }
    Ok(())
}

/// The in-kernel part and the rule updates (`kernel`, `rules`; either or both), on one limiter
/// whose rule sets and population each step leaves for the next, then the 4 MiB store.
fn kernel_and_rules(
    report: &mut Report,
    opts: &Options,
    refs: &refs::Refs,
    want: impl Fn(Part) -> bool,
) -> Result<()> {
    let mut limiter = kernel::Limiter::new("bench", DEFAULT_MAX_BUCKETS, kernel::BASE_RULES)?;
    let mut tracked_full = None;
    if want(Part::Kernel) {
        kernel::hot(report, opts, refs, &limiter)?;
        kernel::cut_ab(report, opts, refs, &limiter, DEFAULT_MAX_BUCKETS)?;
        kernel::probes(
            report,
            opts,
            refs,
            &limiter,
            "6_rules",
            "6 rules, few buckets",
            true,
        )?;
        limiter
            .install(&ratelimit::config::Config::parse(kernel::TCP_RULES, "bench.toml")?.rules)?;
        kernel::hot_tcp_flags(report, opts, refs, &limiter)?;
        limiter
            .install(&ratelimit::config::Config::parse(kernel::LIMIT_RULES, "bench.toml")?.rules)?;
        kernel::hot_limits(report, opts, refs, &limiter)?;
        limiter
            .install(&ratelimit::config::Config::parse(kernel::BASE_RULES, "bench.toml")?.rules)?;
        kernel::layered_flood(report, opts, refs)?;
    }
    if want(Part::Rules) {
        rules::latency(
            report,
            opts,
            &mut limiter,
            "empty",
            "bucket store nearly empty",
        )?;
    }
    if want(Part::Kernel) {
        limiter.install(&rules::many_rules(1000)?)?;
        kernel::hot_with_rules(report, opts, refs, &limiter)?;
        kernel::probes(
            report,
            opts,
            refs,
            &limiter,
            "10k_rules",
            "10,006 rules",
            false,
        )?;
        limiter
            .install(&ratelimit::config::Config::parse(kernel::BASE_RULES, "bench.toml")?.rules)?;
        let tracked = kernel::populations(report, opts, refs, &limiter, false)?;
        if !opts.quick {
            tracked_full = Some(tracked);
        }
        kernel::probes(
            report,
            opts,
            refs,
            &limiter,
            "full",
            if opts.quick {
                "6 rules, 100k tracked"
            } else {
                "6 rules, bucket store full"
            },
            false,
        )?;
        kernel::cpus(report, opts, &limiter)?;
        if want(Part::Rules) {
            let what = format!("{} tracked sources", limiter.tdp.maps().bucket_count()?);
            rules::latency(report, opts, &mut limiter, "full", &what)?;
        }
    }
    kernel::memory(report, &limiter, tracked_full)?;
    drop(limiter);
    if want(Part::Kernel) {
        // The same new sources with a store of 4 MiB: what the memory beyond the last-level
        // cache costs them.
        let small =
            kernel::Limiter::new("bench_cache", kernel::IN_CACHE_BUCKETS, kernel::BASE_RULES)?;
        kernel::populations(report, opts, refs, &small, true)?;
    }
    Ok(())
}

/// `limits`, `cut` and `lru` without the rest of `kernel`, each on a limiter of its own.
fn limits_and_cut(
    report: &mut Report,
    opts: &Options,
    refs: &refs::Refs,
    want: impl Fn(Part) -> bool,
) -> Result<()> {
    if want(Part::Limits) {
        let limiter = kernel::Limiter::new("bench", DEFAULT_MAX_BUCKETS, kernel::LIMIT_RULES)?;
        kernel::hot_limits(report, opts, refs, &limiter)?;
        drop(limiter);
        kernel::layered_flood(report, opts, refs)?;
    }
    if want(Part::Cut) {
        let limiter = kernel::Limiter::new("bench", DEFAULT_MAX_BUCKETS, kernel::BASE_RULES)?;
        kernel::cut_ab(report, opts, refs, &limiter, DEFAULT_MAX_BUCKETS)?;
    }
    if want(Part::Lru) {
        let limiter = kernel::Limiter::new("bench", DEFAULT_MAX_BUCKETS, kernel::BASE_RULES)?;
        kernel::populations(report, opts, refs, &limiter, false)?;
    }
    Ok(())
}

// Stays whole: one target after the other, in the order the table prints them.
fn targets(r: &Report) -> Vec<Target> {
    let mut t = Vec::new();
    let ratio = |a: &str, b: &str| Some(r.value(a)? / r.value(b)?);
    let fmt = |v: Option<f64>| v.map_or_else(|| "not measured".to_string(), |v| format!("{v:.2}"));

    for (key, what, most) in [
        ("kernel.limiter.admitted", "admitted", 2.5),
        (
            "kernel.limiter.admitted_coarse_only",
            "admitted, a rule on the coarse clock alone",
            2.5,
        ),
        ("kernel.limiter.dropped", "dropped", 3.0),
    ] {
        let x = ratio(key, "kernel.floor");
        t.push(Target {
            goal: format!("limiter hot path ({what}) <= {most}x the floor's ns/packet"),
            met: x.map(|x| x <= most),
            evidence: format!(
                "{} ns vs floor {} ns: {}x",
                fmt(r.value(key)),
                fmt(r.value("kernel.floor")),
                fmt(x)
            ),
        });
    }
    for (key, n, most) in [
        ("kernel.limiter.limits_2", 2, 1.5),
        ("kernel.limiter.limits_3", 3, 2.0),
    ] {
        let x = ratio(key, "kernel.limiter.limits_1");
        let floor = r.value("kernel.floor_limits");
        let over = |k: &str| Some(r.value(k)? - floor?);
        t.push(Target {
            goal: format!(
                "admitted packet under a rule with {n} limits <= {most}x the one-limit figure"
            ),
            met: x.map(|x| x <= most),
            evidence: format!(
                "{} ns vs {} ns: {}x (over the floor {} ns: {} vs {} ns)",
                fmt(r.value(key)),
                fmt(r.value("kernel.limiter.limits_1")),
                fmt(x),
                fmt(floor),
                fmt(over(key)),
                fmt(over("kernel.limiter.limits_1")),
            ),
        });
    }
    {
        let (with, without, diff) = kernel::cut_ab_keys("admitted");
        let d = r.value(&diff);
        t.push(Target {
            goal: "the handling of cut packets adds <= 2 ns to a whole packet's admitted figure \
                   (with and without it, alternately in this run)"
                .into(),
            met: d.map(|d| d <= 2.0),
            evidence: format!(
                "{} ns with vs {} ns without: {} ns (median of the paired differences)",
                fmt(r.value(&with)),
                fmt(r.value(&without)),
                fmt(d),
            ),
        });
    }
    // Differences against a driver floor measured next to them.
    let over = |key: &str, floor: &str| Some(r.value(key)? - r.value(floor)?);
    let tracked = |key: &str| {
        r.get(key)
            .and_then(|f| f.detail["tracked_buckets"].as_u64())
            .map_or_else(|| "?".into(), |v| v.to_string())
    };
    for (key, floor, goal, most) in [
        (
            "kernel.pop.1m.known",
            "kernel.pop.1m.known_floor",
            "random known source with 1M tracked <= 200 ns over its floor",
            200.0,
        ),
        (
            "kernel.pop.full.new",
            "kernel.pop.full.new_floor",
            "new source with the store full <= 150 ns over its floor",
            150.0,
        ),
    ] {
        let x = over(key, floor);
        // What one random record of the store costs by itself in the same population (see
        // `progs::Touch`): the part of the figure no store layout can save.
        let memory = over(&format!("{key}_memory_floor"), floor);
        // A lookup reads the records of the key's two sets (a new key's, all eight of them).
        let candidates = over(&format!("{key}_candidates_floor"), floor)
            .map(|c| {
                format!(
                    "; 8 records of two sets of a page alone: {} ns",
                    fmt(Some(c))
                )
            })
            .unwrap_or_default();
        // A new source's first packet passes without a bucket (the first-packet table): beside
        // it, what one that makes its bucket costs (`kernel.pop.*.new_made`).
        let made = over(&format!("{key}_made"), floor)
            .map(|m| format!("; a new source making its bucket: {} ns over", fmt(Some(m))))
            .unwrap_or_default();
        t.push(Target {
            goal: goal.into(),
            met: x.map(|x| x <= most),
            evidence: format!(
                "{} ns vs driver floor {} ns: {} ns over ({} buckets tracked); reading one \
                 random record of the store alone: {} ns over the same driver floor{}",
                fmt(r.value(key)),
                fmt(r.value(floor)),
                fmt(x),
                tracked(key),
                fmt(memory),
                candidates,
            ) + &made,
        });
    }
    // Against F1, one dependent read of a region the size of the store (issue #36, `f1.rs`):
    // the true floor of a source whose record is not in any cache.
    let f1 = r.value("kernel.f1");
    for (key, floor, most, stretch, what) in [
        (
            "kernel.pop.1m.known",
            "kernel.pop.1m.known_floor",
            1.6,
            None,
            "random known source with 1M tracked",
        ),
        (
            "kernel.pop.full.new",
            "kernel.pop.full.new_floor",
            2.0,
            Some(1.5),
            "new source with the store full",
        ),
    ] {
        let x = over(key, floor).zip(f1).map(|(a, f)| a / f);
        // The driver reading the key's records and charging one with a locked add, and no more
        // (`progs::Touch::ChargedCandidates`): the memory part of the path, as it orders.
        let charged = over(&format!("{key}_charged_floor"), floor);
        t.push(Target {
            goal: format!(
                "{what}: <= {most}x F1 over its floor{}",
                stretch.map_or_else(String::new, |s| format!(" (stretch {s}x)"))
            ),
            met: x.map(|x| x <= most),
            evidence: format!(
                "{} ns over vs F1 {} ns: {}x{}; the memory a charge cannot do without, the key's \
                 8 records and one locked add to one of them, alone: {} ns over ({}x F1)",
                fmt(over(key, floor)),
                fmt(f1),
                fmt(x),
                match (stretch, x) {
                    (Some(s), Some(x)) if x <= s => format!("; stretch {s}x met"),
                    (Some(s), Some(_)) => format!("; stretch {s}x missed"),
                    _ => String::new(),
                },
                fmt(charged),
                fmt(charged.zip(f1).map(|(c, f)| c / f)),
            ),
        });
    }
    // The LRU contender (issue #36, `lru.rs`): the limiter's ns over the driver floor against
    // the contender's, measured in turns with it over the same floor.
    for (key, lru, floor, most, what) in [
        (
            "kernel.pop.1m.known",
            "known_1m",
            "kernel.pop.1m.known_floor",
            0.55,
            "random known source with 1M tracked",
        ),
        (
            "kernel.pop.full.new",
            "new_full",
            "kernel.pop.full.new_floor",
            0.45,
            "new source with the store full",
        ),
    ] {
        let ours = over(key, floor);
        let shared = over(&format!("kernel.lru.{lru}"), floor);
        let percpu = over(&format!("kernel.lru_percpu.{lru}"), floor);
        let x = ours.zip(shared).map(|(a, b)| a / b);
        t.push(Target {
            goal: format!(
                "{what}: limiter <= {most}x the LRU contender's ns over the driver floor"
            ),
            met: x.map(|x| x <= most),
            evidence: format!(
                "limiter {} ns over vs LRU_HASH {} ns over: {}x; LRU_PERCPU_HASH {} ns over \
                 ({}x){}",
                fmt(ours),
                fmt(shared),
                fmt(x),
                fmt(percpu),
                fmt(ours.zip(percpu).map(|(a, b)| a / b)),
                // The least any layout that reads the source's record pays in this driver (its
                // runs' reads overlap, so below F1): the goal against it.
                over(&format!("{key}_memory_floor"), floor)
                    .map(|m| format!(
                        "; goal {} ns, one random record of the store alone {} ns",
                        fmt(shared.map(|s| s * most)),
                        fmt(Some(m))
                    ))
                    .unwrap_or_default(),
            ),
        });
    }
    let mem = r.value("memory.kernel_per_tracked_source");
    t.push(Target {
        goal: "<= 64 bytes of kernel memory per tracked source (store full; tags and first-packet \
               slots included)"
            .into(),
        met: mem.map(|m| m <= 64.0),
        evidence: r
            .get("memory.kernel_per_tracked_source")
            .map_or_else(String::new, |f| {
                format!(
                    "{} bytes: the store and its tags {} bytes a record (memlock {} of {} \
                     records vs {} of {}; a fixed {} bytes beside them), the first-packet \
                     slots {} bytes, over {} tracked buckets ({} with the store's fixed part)",
                    fmt(mem),
                    f.detail["bytes_per_record"],
                    f.detail["memlock_bytes"],
                    f.detail["max_entries"],
                    f.detail["small_memlock_bytes"],
                    f.detail["small_max_entries"],
                    f.detail["fixed_bytes"],
                    f.detail["first_packets_memlock_bytes"],
                    f.detail["tracked_buckets"],
                    f.detail["memlock_per_tracked"],
                )
            }),
    });
    let change = r.value("control.full.change_1_of_10k");
    t.push(Target {
        goal: "change 1 of 10,000 rules with ~1M tracked <= 100 ms".into(),
        met: change.map(|c| c <= 100.0),
        evidence: format!(
            "{} ms ({})",
            fmt(change),
            r.get("control.full.change_1_of_10k")
                .map_or_else(String::new, |f| f.label.clone())
        ),
    });
    let x = ratio("e2e.hot.limiter", "e2e.hot.drop_all");
    t.push(Target {
        goal: "end to end, hot source: limiter >= 95% of the drop-all floor (#36: >= 90%)".into(),
        met: x.map(|x| x >= 0.95),
        evidence: format!(
            "{} Mpps vs {} Mpps: {}%; #36's 90%: {}",
            fmt(r.value("e2e.hot.limiter")),
            fmt(r.value("e2e.hot.drop_all")),
            fmt(x.map(|x| x * 100.0)),
            verdict(x.map(|x| x >= 0.90)),
        ),
    });
    let x = ratio("e2e.random.limiter", "e2e.random.xdp_pass");
    t.push(Target {
        goal: "end to end, random sources: limiter >= 85% of an XDP_PASS receiver, in turns \
               (#36: >= 80%)"
            .into(),
        met: x.map(|x| x >= 0.85),
        evidence: format!(
            "{} Mpps vs {} Mpps: {}%; #36's 80%: {}",
            fmt(r.value("e2e.random.limiter")),
            fmt(r.value("e2e.random.xdp_pass")),
            fmt(x.map(|x| x * 100.0)),
            verdict(x.map(|x| x >= 0.80)),
        ),
    });
    let x = ratio("e2e.known.limiter", "e2e.known.nftables");
    t.push(Target {
        goal: "end to end, known sources (2^19, tables half full): limiter >= 1.3x nftables' \
               dynamic set"
            .into(),
        met: x.map(|x| x >= 1.3),
        evidence: format!(
            "{} Mpps vs {} Mpps: {}x (LRU_HASH {} Mpps, LRU_PERCPU_HASH {} Mpps; XDP_PASS {} Mpps)",
            fmt(r.value("e2e.known.limiter")),
            fmt(r.value("e2e.known.nftables")),
            fmt(x),
            fmt(r.value("e2e.known.lru")),
            fmt(r.value("e2e.known.lru_percpu")),
            fmt(r.value("e2e.known.xdp_pass")),
        ),
    });
    let x = ratio("e2e.random.limiter", "e2e.random.lru");
    t.push(Target {
        goal: "end to end, random sources: limiter >= 1.25x the LRU contender (XDP, LRU_HASH)"
            .into(),
        met: x.map(|x| x >= 1.25),
        evidence: format!(
            "{} Mpps vs {} Mpps: {}x (LRU_PERCPU_HASH {} Mpps)",
            fmt(r.value("e2e.random.limiter")),
            fmt(r.value("e2e.random.lru")),
            fmt(x),
            fmt(r.value("e2e.random.lru_percpu")),
        ),
    });
    for (key, nft_key, order) in [
        (
            "e2e.random.limiter_aggregate",
            "e2e.random.nftables_aggregate",
            "per-source limit first",
        ),
        (
            "e2e.random.limiter_aggregate_first",
            "e2e.random.nftables_aggregate_first",
            "per-rule limit first",
        ),
    ] {
        let nft = ratio(nft_key, "e2e.random.drop_all_layered");
        let x = ratio(key, "e2e.random.drop_all_layered");
        t.push(Target {
            goal: format!(
                "end to end, random sources under a per-source + per-rule limit ({order}; the \
                 excess dropped by the aggregate): limiter >= 90% of the drop-all floor"
            ),
            met: x.map(|x| x >= 0.90),
            evidence: format!(
                "{} Mpps vs floor {} Mpps: {}%; nftables with the same two levels in the same \
                 order {} Mpps ({}% of the floor; limiter {}x nftables)",
                fmt(r.value(key)),
                fmt(r.value("e2e.random.drop_all_layered")),
                fmt(x.map(|x| x * 100.0)),
                fmt(r.value(nft_key)),
                fmt(nft.map(|x| x * 100.0)),
                fmt(ratio(key, nft_key)),
            ),
        });
    }
    let mut polite = Vec::new();
    let mut met = Some(true);
    for pattern in ["hot", "random"] {
        let Some(f) = r.get(&format!("e2e.{pattern}.limiter")) else {
            met = None;
            continue;
        };
        let p = &f.detail["polite"];
        let dropped = p["bucket_dropped"].as_u64();
        let (sent, received) = (p["sent"].as_u64(), p["received"].as_u64());
        if dropped != Some(0) {
            met = met.map(|_| false);
        }
        polite.push(format!(
            "{pattern}: sent {}, received {}, dropped by the limiter {}",
            sent.map_or("?".into(), |v| v.to_string()),
            received.map_or("?".into(), |v| v.to_string()),
            dropped.map_or("? (bucket evicted)".into(), |v| v.to_string()),
        ));
    }
    t.push(Target {
        goal: "a polite known source (200 pps) is never dropped during the floods".into(),
        met,
        evidence: if polite.is_empty() {
            "not measured".into()
        } else {
            polite.join("; ")
        },
    });
    for target in &mut t {
        if target.met.is_none() {
            target.evidence = "not measured in this run".into();
        }
    }
    t
}

/// Which contenders stopped limiting new sources under the random flood: a table that is full
/// and does not evict (nftables' dynamic set: `update` fails, the rule no longer matches) lets a
/// fresh source flood unlimited. Told by the fresh flooder of the last run: more than twice
/// what its limit allows passed. The random flood's ratio to nftables is given here, not as a
/// target: nftables does less there (one hash miss a frame, no insert); the fair race is
/// `e2e.known.*`.
/// A second threshold's verdict, printed in a target's evidence.
fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "missed",
        None => "n/a",
    }
}

fn overflow_notes(r: &Report) -> Vec<String> {
    let mut notes = Vec::new();
    for f in r
        .figures
        .iter()
        .filter(|f| f.key.starts_with("e2e.random."))
    {
        let a = &f.detail["fresh_abuser"];
        let (Some(received), Some(allows)) = (a["received"].as_u64(), a["limit_allows"].as_u64())
        else {
            continue;
        };
        if received > 2 * allows {
            notes.push(format!(
                "{}: its table overflowed under the random flood and stopped limiting new \
                 sources: a fresh source flooding passed {received} of {} (its limit allows \
                 ~{allows}); its Mpps there are those of a contender that does not limit.",
                f.label, a["sent"],
            ));
        }
    }
    if let (Some(l), Some(n)) = (
        r.value("e2e.random.limiter"),
        r.value("e2e.random.nftables"),
    ) {
        notes.push(format!(
            "Random flood, limiter vs nftables' dynamic set (tables full): {l:.3} vs {n:.3} Mpps, \
             {:.2}x; not a target (see the known-source race).",
            l / n
        ));
    }
    notes
}

fn notes() -> Vec<String> {
    vec![
        "In-kernel figures: BPF_PROG_TEST_RUN with repeat (1,000,000; new sources 20,000), the \
         kernel's mean ns per run; it reports whole ns (truncated), so 0.5 ns is added to each."
            .into(),
        "'(driver)' figures: a hand-assembled program rewrites the frame's source on every run \
         (next address, or the next of the tracked ones in a shuffled order, read as a stream) \
         and tail-calls the limiter; their floor is the same driver tail-calling XDP_PASS. \
         Limiter cost = figure - its floor. 'memory:' figures: the same driver reading records \
         of the bucket store first (one random record, or the 8 records of two random sets of a \
         page as a new key's packet reads them; its next source waits for the reads), then \
         XDP_PASS: what the memory a packet cannot do without costs alone, with none of the \
         limiter's work."
            .into(),
        "Probes: hand-assembled programs doing one operation of the fast path (a clock read, a map \
         lookup in the limiter's own maps), then XDP_PASS; cost = probe - floor."
            .into(),
        "Populations: the bucket store is grown one packet per source (a source's first packet \
         creates its bucket) until it holds the number stated (counted in the store, printed in \
         each label); each run's new sources are freed again afterwards. 'Several CPUs': one \
         thread pinned to each CPU runs the same hot frame at the same time."
            .into(),
        "LRU contender (issue #36): a hand-assembled XDP program keeping a GCRA arrival time \
         per IPv4 source in a kernel LRU_HASH (or LRU_PERCPU_HASH) of 2^20 entries, as \
         XDP-Firewall and most XDP limiters do (precise clock, a plain store; a new source \
         inserted with BPF_ANY, evicting when full). Its map holds the limiter's population \
         (plus never-sent sources up to 2^20 when the store is full), its drivers are the \
         limiter's (same addresses, same frames) and run in turns with them, so the limiter's \
         driver floors are its floors."
            .into(),
        "F1: each run reads the line of a 64 MiB chain (one random cycle through all its 64-byte \
         lines, 4 KiB pages) that the previous run's read named, so no two runs' misses overlap: \
         one whole read of memory, chase - its floor (the same program without the chain read). \
         The independent read beside it is the 'memory:' driver's (its address drawn at random, \
         so consecutive runs' misses overlap), on the same chain."
            .into(),
        "End to end: generator and receiver share one CPU (the receiving NAPI poll runs when the \
         test run re-enables bottom halves), so Mpps is the whole pipeline's rate on one core. \
         The hot source's limiter and floor, and the layered cases and their floor, take turns of \
         one run each (at least 10 turns)."
            .into(),
        "The machine may be shared: see the load averages in the header; the spread column shows \
         how much runs disagreed."
            .into(),
    ]
}
