//! In-kernel cost per packet, through BPF_PROG_TEST_RUN: the floor (an XDP_PASS program) and the
//! limiter on the same frames, interleaved run by run so that both see the same machine.
//!
//! Two ways of timing, each compared only with a floor timed the same way:
//! - *repeat*: one frame run 1,000,000 times inside the kernel; the kernel reports the mean time
//!   per run (in whole nanoseconds, truncated). A hot source, with its bucket in cache.
//! - *single*: thousands of BPF_PROG_TEST_RUN calls of one run each, every call a different frame
//!   (a new source, or a known source picked at random among those tracked); the mean of the
//!   kernel's per-call times. Each includes the timer's own overhead (a clock read, bottom halves
//!   off and on), which the single-run floor measures.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use aya::{
    maps::{HashMap, Map, MapData},
    programs::{TestRun as _, TestRunOptions, Xdp},
};
use ratelimit::{
    compile::{compile, CompiledRuleSet, RuleIds},
    config::{Config, RuleConfig},
};
use ratelimit_common::{global, map_names, rule_flags, Bucket, BucketKey};
use ratelimit_testbed::{packet::eth, TestDataplane};
use serde_json::json;

use crate::{
    refs::{Refs, PASS},
    report::{Figure, Report},
    Options,
};

const SECTION: &str = "In-kernel cost per packet (BPF_PROG_TEST_RUN)";
const SECTION_POP: &str = "In-kernel cost per packet vs tracked sources (BPF_PROG_TEST_RUN)";
/// Single runs slower than this were interrupted or preempted: left out of the mean (and counted).
const CLIP_NS: u64 = 50_000;

/// The limiter's rules for the in-kernel runs: one per case, on prefixes of their own.
/// `rate = 1e9` never runs dry in a test run (at most a few tens of millions of runs a second);
/// a tolerance of 1 s selects the coarse clock (see `rule_record`), 1 ms the precise one.
pub const BASE_RULES: &str = r#"
[[rule]]
name = "admit"
source = "198.18.0.0/24"
rate = 1000000000
burst = 1000000000

[[rule]]
name = "admit-precise-clock"
source = "198.18.1.0/24"
rate = 1000000000
burst = 1000000

[[rule]]
name = "drop"
source = "198.18.2.0/24"
rate = 1
burst = 1

[[rule]]
name = "allow"
source = "198.18.3.0/24"
action = "allow"

[[rule]]
name = "admit-v6"
source = "2001:db8::/32"
rate = 1000000000
burst = 1000000000

[[rule]]
name = "tracked"
source = "10.0.0.0/8"
rate = 1000000000
burst = 1000000000
"#;

/// The limiter loaded under a throwaway pin directory, with rule ids kept here so that rule sets
/// of any size can be compiled against what is installed.
pub struct Limiter {
    /// The data plane.
    pub tdp: TestDataplane,
    ids: RuleIds,
    /// The rule set in force.
    pub set: CompiledRuleSet,
}

impl Limiter {
    /// Loads the program with a bucket map of `max_buckets` and installs `rules` (TOML).
    pub fn new(name: &str, max_buckets: u32, rules: &str) -> Result<Self> {
        let tdp = TestDataplane::new(name, max_buckets)?;
        let rules = Config::parse(rules, "bench.toml")?.rules;
        let mut limiter = Self { tdp, ids: RuleIds::new(), set: compile(&[], &RuleIds::new())? };
        limiter.install(&rules)?;
        Ok(limiter)
    }

    /// Compiles and installs `rules`; returns how long compiling and installing took.
    pub fn install(&mut self, rules: &[RuleConfig]) -> Result<(Duration, Duration)> {
        let start = Instant::now();
        let set = compile(rules, &self.ids)?;
        let compiled = start.elapsed();
        let start = Instant::now();
        self.tdp.dataplane().install(&set)?;
        let installed = start.elapsed();
        self.ids.commit(&set)?;
        self.set = set;
        Ok((compiled, installed))
    }

    /// Id of the installed rule `name`.
    pub fn id(&self, name: &str) -> Result<u32> {
        self.ids.id_of(name).with_context(|| format!("no rule {name} installed"))
    }

    /// The XDP program.
    pub fn program(&self) -> &Xdp {
        self.tdp.program()
    }
}

/// Runs `frame` `repeat` times in one call; returns the kernel's mean ns per run, the wall-clock
/// ns per run of the whole call, and the XDP action.
fn repeat_ns(prog: &Xdp, frame: &[u8], repeat: u32) -> Result<(f64, f64, u32)> {
    let opts = TestRunOptions { data_in: Some(frame), repeat, ..TestRunOptions::new() };
    let start = Instant::now();
    let res = prog.test_run(opts).context("BPF_PROG_TEST_RUN")?;
    let wall = start.elapsed().as_secs_f64() * 1e9 / f64::from(repeat);
    #[expect(clippy::cast_precision_loss, reason = "nanoseconds per run")]
    Ok((res.duration.as_nanos() as f64, wall, res.return_value))
}

/// `n` single runs of `frame`, rewritten by `prepare(frame, i)` before run `i`; the mean of the
/// kernel's per-call times and how many calls were left out as interrupted.
fn single_runs(
    prog: &Xdp,
    frame: &mut [u8],
    n: usize,
    mut prepare: impl FnMut(&mut [u8], usize),
) -> Result<(f64, usize)> {
    let (mut total, mut kept, mut clipped) = (0u128, 0u32, 0usize);
    for i in 0..n {
        prepare(frame, i);
        let opts = TestRunOptions { data_in: Some(frame), repeat: 1, ..TestRunOptions::new() };
        let ns = prog.test_run(opts).context("BPF_PROG_TEST_RUN")?.duration.as_nanos();
        if ns > u128::from(CLIP_NS) {
            clipped += 1;
        } else {
            total += ns;
            kept += 1;
        }
    }
    if kept == 0 {
        bail!("every single run took over {CLIP_NS} ns");
    }
    #[expect(clippy::cast_precision_loss, reason = "nanoseconds")]
    Ok((total as f64 / f64::from(kept), clipped))
}

fn v4_frame(src: [u8; 4]) -> Vec<u8> {
    eth().ipv4(src.into(), [198, 18, 255, 254].into()).udp(40_000, 9).pad_to(60).build()
}

/// Source address number `i` of the tracked population (10.0.0.0/9), or of the never-seen
/// sources (10.128.0.0/9) when `fresh`.
fn tracked_addr(i: usize, fresh: bool) -> [u8; 4] {
    #[expect(clippy::cast_possible_truncation, reason = "bytes of i, masked")]
    let b = |shift: u32| (i >> shift) as u8;
    [10, (b(16) & 0x7f) | if fresh { 0x80 } else { 0 }, b(8), b(0)]
}

fn set_v4_src(frame: &mut [u8], src: [u8; 4]) {
    frame[26..30].copy_from_slice(&src);
}

/// A hot case: one frame, run `repeat` times per run.
struct HotCase {
    key: &'static str,
    label: &'static str,
    frame: Vec<u8>,
    kernel: Vec<f64>,
    wall: Vec<f64>,
    action: u32,
}

impl HotCase {
    fn new(key: &'static str, label: &'static str, frame: Vec<u8>) -> Self {
        Self { key, label, frame, kernel: Vec::new(), wall: Vec::new(), action: 0 }
    }
}

/// The kernel reports whole nanoseconds, truncated: half a nanosecond is added back so that a
/// floor of "7" (7.0 to 7.99) is not taken for less than it is.
const TRUNCATION: f64 = 0.5;

/// Measures `cases` (limiter) and the floor, interleaved: each run measures every case once.
fn measure_hot(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
    floor_key: &str,
    cases: &mut [HotCase],
) -> Result<()> {
    let floor_frame = v4_frame([198, 18, 0, 1]);
    let (mut floor, mut floor_wall) = (Vec::new(), Vec::new());
    // Warm up: create the buckets, spend the `drop` rule's one-packet burst.
    for c in cases.iter() {
        repeat_ns(limiter.program(), &c.frame, 1000)?;
    }
    for _ in 0..opts.runs {
        crate::check_interrupted()?;
        let (k, w, _) = repeat_ns(refs.program(PASS), &floor_frame, opts.repeat)?;
        floor.push(k + TRUNCATION);
        floor_wall.push(w);
        for c in cases.iter_mut() {
            let (k, w, action) = repeat_ns(limiter.program(), &c.frame, opts.repeat)?;
            c.kernel.push(k + TRUNCATION);
            c.wall.push(w);
            c.action = action;
        }
    }
    if report.get(floor_key).is_none() {
        report.add(Figure {
            key: floor_key.into(),
            section: SECTION,
            label: "floor: XDP_PASS program (bench_pass), hot frame".into(),
            unit: "ns/pkt",
            runs: floor,
            baseline: None,
            detail: json!({ "repeat": opts.repeat, "wall_ns_per_run": floor_wall }),
        });
    }
    for c in cases.iter() {
        report.add(Figure {
            key: c.key.into(),
            section: SECTION,
            label: c.label.into(),
            unit: "ns/pkt",
            runs: c.kernel.clone(),
            baseline: Some(floor_key.into()),
            detail: json!({
                "repeat": opts.repeat,
                "wall_ns_per_run": c.wall,
                "xdp_action": action_name(c.action),
            }),
        });
    }
    Ok(())
}

fn action_name(action: u32) -> &'static str {
    match action {
        0 => "XDP_ABORTED",
        1 => "XDP_DROP",
        2 => "XDP_PASS",
        3 => "XDP_TX",
        4 => "XDP_REDIRECT",
        _ => "?",
    }
}

/// The hot cases of the issue, plus the variants that show where the time goes.
fn hot_cases() -> Vec<HotCase> {
    vec![
        HotCase::new(
            "kernel.limiter.admitted",
            "limiter: known source, admitted (coarse clock)",
            v4_frame([198, 18, 0, 1]),
        ),
        HotCase::new(
            "kernel.limiter.dropped",
            "limiter: known source, dropped",
            v4_frame([198, 18, 2, 1]),
        ),
        HotCase::new(
            "kernel.limiter.ipv6",
            "limiter: IPv6 known source, admitted",
            eth()
                .ipv6("2001:db8::1".parse().expect("address"), "2001:db8::2".parse().expect("address"))
                .udp(40_000, 9)
                .pad_to(78)
                .build(),
        ),
        HotCase::new(
            "kernel.limiter.admitted_precise_clock",
            "variant: admitted, precise clock (tolerance < 20 ms)",
            v4_frame([198, 18, 1, 1]),
        ),
        HotCase::new(
            "kernel.limiter.allow_rule",
            "variant: allow rule (parse, classify, count; no bucket)",
            v4_frame([198, 18, 3, 1]),
        ),
        HotCase::new(
            "kernel.limiter.no_match",
            "variant: no rule matches (parse, prefix lookup miss)",
            v4_frame([198, 19, 0, 1]),
        ),
    ]
}

/// The hot-path figures.
pub fn hot(report: &mut Report, opts: &Options, refs: &Refs, limiter: &Limiter) -> Result<()> {
    crate::announce("in-kernel cost: floor and limiter, hot frames");
    for (name, coarse) in [("admit", true), ("admit-precise-clock", false)] {
        let rule = limiter.set.rule(limiter.id(name)?).context("rule in set")?.rule;
        if (rule.flags & rule_flags::COARSE_CLOCK != 0) != coarse {
            bail!("rule {name}: expected the {} clock", if coarse { "coarse" } else { "precise" });
        }
    }
    let mut cases = hot_cases();
    measure_hot(report, opts, refs, limiter, "kernel.floor", &mut cases)
}

/// The hot admitted case again, under a rule set of `n` rules (LPM trie of as many prefixes).
pub fn hot_with_rules(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
    n: usize,
) -> Result<()> {
    let mut cases = vec![HotCase::new(
        "kernel.limiter.admitted_10k_rules",
        "variant: admitted, with 10,000 more rules installed",
        v4_frame([198, 18, 0, 1]),
    )];
    debug_assert_eq!(n, 10_000, "label says 10,000");
    measure_hot(report, opts, refs, limiter, "kernel.floor_10k_rules", &mut cases)?;
    if let Some(f) = report.figures.iter_mut().find(|f| f.key == "kernel.floor_10k_rules") {
        f.label = "floor: XDP_PASS, re-measured next to the 10,000-rule case".into();
    }
    Ok(())
}

/// Tracked-source populations: the hot path, a random known source and a new source, with the
/// bucket map holding each population in turn (grown by running frames through the program).
pub fn populations(report: &mut Report, opts: &Options, refs: &Refs, limiter: &Limiter) -> Result<()> {
    let tracked = limiter.id("tracked")?;
    let capacity = limiter.tdp.maps().bucket_capacity()?;
    let mut buckets = bucket_map(limiter)?;
    let mut frame = v4_frame(tracked_addr(0, false));
    let mut populated = 0usize;
    let mut fresh_next = 0usize;
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let mut steps: Vec<(usize, &str, &str)> = vec![
        (1_000, "1k", "1k tracked"),
        (100_000, "100k", "100k tracked"),
        (1_000_000, "1m", "1M tracked"),
        (capacity as usize + capacity as usize / 8, "full", "map full, evicting"),
    ];
    if opts.quick {
        steps.truncate(2);
    }
    for (target, tag, what) in steps {
        crate::check_interrupted()?;
        crate::announce(&format!("in-kernel cost with {what} (populating to {target} sources)"));
        let start = Instant::now();
        while populated < target {
            set_v4_src(&mut frame, tracked_addr(populated, false));
            let opts = TestRunOptions { data_in: Some(&frame), repeat: 1, ..TestRunOptions::new() };
            limiter.program().test_run(opts).context("BPF_PROG_TEST_RUN")?;
            populated += 1;
        }
        let fill_secs = start.elapsed().as_secs_f64();
        let entries = limiter.tdp.global().counters[global::NEW_BUCKETS];

        let (mut hot, mut known, mut new, mut floor) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut clipped = 0usize;
        let hot_frame = v4_frame(tracked_addr(populated / 2, false));
        repeat_ns(limiter.program(), &hot_frame, 10)?;
        let floor_frame = v4_frame([198, 18, 0, 1]);
        for _ in 0..opts.runs {
            crate::check_interrupted()?;
            let (k, _, _) = repeat_ns(limiter.program(), &hot_frame, opts.repeat)?;
            hot.push(k + TRUNCATION);
            let mut f = floor_frame.clone();
            let (ns, c) = single_runs(refs.program(PASS), &mut f, opts.single, |_, _| {})?;
            floor.push(ns);
            clipped += c;
            let (ns, c) = single_runs(limiter.program(), &mut frame, opts.single, |f, _| {
                rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                #[expect(clippy::cast_possible_truncation, reason = "an index below `populated`")]
                let i = ((rng >> 33) % populated as u64) as usize;
                set_v4_src(f, tracked_addr(i, false));
            })?;
            known.push(ns);
            clipped += c;
            let first = fresh_next;
            let (ns, c) = single_runs(limiter.program(), &mut frame, opts.single, |f, i| {
                set_v4_src(f, tracked_addr(first + i, true));
            })?;
            fresh_next += opts.single;
            new.push(ns);
            clipped += c;
            // Take the new sources out again, so the population stays what it says.
            for i in first..fresh_next {
                let mut addr = [0u8; 16];
                addr[..4].copy_from_slice(&tracked_addr(i, true));
                let key = BucketKey { rule: tracked, family: 4, _pad: [0; 3], addr };
                let _ = buckets.remove(&key);
            }
        }
        let detail = json!({
            "target_sources": target,
            "buckets_created_so_far": entries,
            "bucket_capacity": capacity,
            "populate_seconds": fill_secs,
            "single_runs_per_run": opts.single,
            "single_runs_clipped": clipped,
        });
        let floor_key = format!("kernel.single_floor.{tag}");
        report.add(Figure {
            key: floor_key.clone(),
            section: SECTION_POP,
            label: format!("floor: XDP_PASS, single runs ({what})"),
            unit: "ns/pkt",
            runs: floor,
            baseline: None,
            detail: detail.clone(),
        });
        report.add(Figure {
            key: format!("kernel.pop.{tag}.hot"),
            section: SECTION_POP,
            label: format!("limiter: hot known source, {what}"),
            unit: "ns/pkt",
            runs: hot,
            baseline: Some("kernel.floor".into()),
            detail: detail.clone(),
        });
        report.add(Figure {
            key: format!("kernel.pop.{tag}.known"),
            section: SECTION_POP,
            label: format!("limiter: random known source, single runs, {what}"),
            unit: "ns/pkt",
            runs: known,
            baseline: Some(floor_key.clone()),
            detail: detail.clone(),
        });
        report.add(Figure {
            key: format!("kernel.pop.{tag}.new"),
            section: SECTION_POP,
            label: format!("limiter: new source (new bucket), single runs, {what}"),
            unit: "ns/pkt",
            runs: new,
            baseline: Some(floor_key),
            detail,
        });
    }
    Ok(())
}

/// The limiter's bucket map, opened from its pin.
fn bucket_map(limiter: &Limiter) -> Result<HashMap<MapData, BucketKey, Bucket>> {
    let path = limiter.tdp.pin_dir().join(map_names::BUCKETS);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    HashMap::try_from(Map::LruHashMap(data)).context("the bucket map as a hash map")
}

/// `memlock` and `max_entries` of a pinned map, from /proc/self/fdinfo.
pub fn map_memory(limiter: &Limiter, name: &str) -> Result<(u64, u64)> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let path = limiter.tdp.pin_dir().join(name);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    let fd = data.fd().as_fd().as_raw_fd();
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
    let field = |k: &str| -> Result<u64> {
        info.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no {k} in fdinfo of {name}"))
    };
    Ok((field("memlock:")?, field("max_entries:")?))
}

/// Kernel memory per tracked source: the bucket map's memory over its capacity (an LRU hash
/// map allocates every entry when it is created).
pub fn memory(report: &mut Report, limiter: &Limiter) -> Result<()> {
    let (memlock, entries) = map_memory(limiter, map_names::BUCKETS)?;
    #[expect(clippy::cast_precision_loss, reason = "bytes")]
    let per = memlock as f64 / entries as f64;
    report.add(Figure {
        key: "memory.kernel_per_tracked_source".into(),
        section: "Memory and control plane",
        label: format!("kernel memory per tracked source (bucket map of {entries}, preallocated)"),
        unit: "bytes",
        runs: vec![per],
        baseline: None,
        detail: json!({ "memlock_bytes": memlock, "max_entries": entries }),
    });
    Ok(())
}
