//! In-kernel cost per packet, through BPF_PROG_TEST_RUN: the floor (an XDP_PASS program) and the
//! limiter on the same frames, interleaved run by run so that both see the same machine.
//!
//! Every figure is one BPF_PROG_TEST_RUN call with `repeat` (1,000,000 unless said otherwise);
//! the kernel reports the mean time per run, in whole nanoseconds (truncated, so half a nanosecond
//! is added back). A hot source runs one frame again and again. New sources and random known
//! sources run behind a *driver* ([`progs::driver`]) that rewrites the source address of the
//! (shared) frame buffer on every run and tail-calls the limiter; the same driver tail-calling
//! `bench_pass` is the floor those are compared with.

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
    progs::{self, Probe, Sources},
    refs::{Refs, PASS},
    report::{Figure, Report},
    Options,
};

const SECTION: &str = "In-kernel cost per packet (BPF_PROG_TEST_RUN)";
const SECTION_POP: &str = "In-kernel cost per packet vs tracked sources (BPF_PROG_TEST_RUN)";

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
        let mut limiter = Self {
            tdp,
            ids: RuleIds::new(),
            set: compile(&[], &RuleIds::new())?,
        };
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
        self.ids
            .id_of(name)
            .with_context(|| format!("no rule {name} installed"))
    }

    /// The XDP program.
    pub fn program(&self) -> &Xdp {
        self.tdp.program()
    }
}

/// Runs `frame` `repeat` times in one call; returns the kernel's mean ns per run, the wall-clock
/// ns per run of the whole call, and the XDP action.
fn repeat_ns(prog: &Xdp, frame: &[u8], repeat: u32) -> Result<(f64, f64, u32)> {
    let opts = TestRunOptions {
        data_in: Some(frame),
        repeat,
        ..TestRunOptions::new()
    };
    let start = Instant::now();
    let res = prog.test_run(opts).context("BPF_PROG_TEST_RUN")?;
    let wall = start.elapsed().as_secs_f64() * 1e9 / f64::from(repeat);
    #[expect(clippy::cast_precision_loss, reason = "nanoseconds per run")]
    Ok((res.duration.as_nanos() as f64, wall, res.return_value))
}

fn v4_frame(src: [u8; 4]) -> Vec<u8> {
    eth()
        .ipv4(src.into(), [198, 18, 255, 254].into())
        .udp(40_000, 9)
        .pad_to(60)
        .build()
}

/// Source address number `i` of the tracked population (10.0.0.0/9), or of the never-seen
/// sources (10.128.0.0/9) when `fresh`.
fn tracked_addr(i: usize, fresh: bool) -> [u8; 4] {
    #[expect(clippy::cast_possible_truncation, reason = "bytes of i, masked")]
    let b = |shift: u32| (i >> shift) as u8;
    [
        10,
        (b(16) & 0x7f) | if fresh { 0x80 } else { 0 },
        b(8),
        b(0),
    ]
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
        Self {
            key,
            label,
            frame,
            kernel: Vec::new(),
            wall: Vec::new(),
            action: 0,
        }
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
            "limiter: known source, dropped (drop window)",
            v4_frame([198, 18, 2, 1]),
        ),
        HotCase::new(
            "kernel.limiter.ipv6",
            "limiter: IPv6 known source, admitted",
            eth()
                .ipv6(
                    "2001:db8::1".parse().expect("address"),
                    "2001:db8::2".parse().expect("address"),
                )
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
            "variant: no rule matches (parse, cached classification)",
            v4_frame([198, 19, 0, 1]),
        ),
    ]
}

/// The hot-path figures.
pub fn hot(report: &mut Report, opts: &Options, refs: &Refs, limiter: &Limiter) -> Result<()> {
    crate::announce("in-kernel cost: floor and limiter, hot frames");
    for (name, coarse) in [("admit", true), ("admit-precise-clock", false)] {
        let rule = limiter
            .set
            .rule(limiter.id(name)?)
            .context("rule in set")?
            .rule;
        if (rule.flags & rule_flags::COARSE_CLOCK != 0) != coarse {
            bail!(
                "rule {name}: expected the {} clock",
                if coarse { "coarse" } else { "precise" }
            );
        }
    }
    let mut cases = hot_cases();
    measure_hot(report, opts, refs, limiter, "kernel.floor", &mut cases)
}

/// The hot admitted case again, with the 10,000 extra rules of [`crate::rules::many_rules`]
/// installed (a prefix trie of as many more prefixes).
pub fn hot_with_rules(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
) -> Result<()> {
    let mut cases = vec![HotCase::new(
        "kernel.limiter.admitted_10k_rules",
        "variant: admitted, with 10,000 more rules installed",
        v4_frame([198, 18, 0, 1]),
    )];
    measure_hot(
        report,
        opts,
        refs,
        limiter,
        "kernel.floor_10k_rules",
        &mut cases,
    )?;
    if let Some(f) = report
        .figures
        .iter_mut()
        .find(|f| f.key == "kernel.floor_10k_rules")
    {
        f.label = "floor: XDP_PASS, re-measured next to the 10,000-rule case".into();
    }
    Ok(())
}

/// A driver ([`progs::driver`]) that tail-calls `target`, with the program array it needs.
struct Driver {
    program: Xdp,
    _array: std::os::fd::OwnedFd,
}

impl Driver {
    fn new(name: &str, sources: Sources, target: &Xdp, refs: &Refs) -> Result<Self> {
        use std::os::fd::AsFd as _;
        let array = progs::prog_array(target)?;
        let program = progs::load(name, &progs::driver(sources, array.as_fd()), refs.dir())?;
        Ok(Self {
            program,
            _array: array,
        })
    }

    /// Runs `frame` `repeat` times; the kernel's ns per run. Fails if the tail call failed.
    fn run(&self, frame: &[u8], repeat: u32) -> Result<f64> {
        let (k, _, action) = repeat_ns(&self.program, frame, repeat)?;
        if action == 0 {
            bail!("the driver's tail call failed (XDP_ABORTED)");
        }
        Ok(k + TRUNCATION)
    }
}

/// Runs `n` sources from `first` on through the limiter twice each, which gives each a bucket
/// (first-packet admission creates it on the second packet); returns how many buckets that created.
pub fn fill(limiter: &Limiter, refs: &Refs, first: [u8; 4], n: u32) -> Result<u64> {
    let before = limiter.tdp.global().counters[global::NEW_BUCKETS];
    let driver = Driver::new(
        "rlb_fill",
        Sources::SequentialTwice,
        limiter.program(),
        refs,
    )?;
    let mut left = n;
    let mut from = first;
    while left > 0 {
        crate::check_interrupted()?;
        let chunk = left.min(1 << 18);
        driver.run(&sequential_from(from), 2 * chunk)?;
        from = (u32::from_be_bytes(from) + chunk).to_be_bytes();
        left -= chunk;
    }
    Ok(limiter.tdp.global().counters[global::NEW_BUCKETS] - before)
}

/// A frame whose source is `first - 1`, for a [`Sources::Sequential`] driver to start at `first`.
fn sequential_from(first: [u8; 4]) -> Vec<u8> {
    v4_frame((u32::from_be_bytes(first).wrapping_sub(1)).to_be_bytes())
}

/// Tracked-source populations: the hot path, a random known source and a new source, with the
/// bucket map holding each population in turn (grown by running frames through the program).
///
/// New and random known sources come from drivers that rewrite the frame's source on every run
/// and tail-call the limiter; the same drivers tail-calling `bench_pass` are their floors.
pub fn populations(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
) -> Result<()> {
    let tracked = limiter.id("tracked")?;
    let capacity = limiter.tdp.maps().bucket_capacity()?;
    let mut buckets = bucket_map(limiter)?;
    // Measures new sources (the next addresses after a start): each one's first packet.
    let grow = Driver::new("rlb_seq_lim", Sources::Sequential, limiter.program(), refs)?;
    let new_floor = Driver::new(
        "rlb_seq_pass",
        Sources::Sequential,
        refs.program(PASS),
        refs,
    )?;
    let mut populated = 0usize;
    let mut fresh_next = 0usize;
    let mut steps: Vec<(usize, &str, &str)> = vec![
        (1_000, "1k", "1k tracked"),
        (100_000, "100k", "100k tracked"),
        (1_000_000, "1m", "1M tracked"),
        (
            capacity as usize + capacity as usize / 8,
            "full",
            "map full, evicting",
        ),
    ];
    if opts.quick {
        steps.truncate(2);
    }
    let new_repeat = u32::try_from(opts.new_sources).context("--new-sources")?;
    for (target, tag, what) in steps {
        crate::check_interrupted()?;
        crate::announce(&format!(
            "in-kernel cost with {what} (populating to {target} sources)"
        ));
        let start = Instant::now();
        if target > populated {
            let n = u32::try_from(target - populated).context("population")?;
            fill(limiter, refs, tracked_addr(populated, false), n)?;
            populated = target;
        }
        let fill_secs = start.elapsed().as_secs_f64();
        let entries = limiter.tdp.global().counters[global::NEW_BUCKETS];
        let n = u32::try_from(populated.min(1 << 23)).context("population")?;
        let known = Driver::new(
            "rlb_known_lim",
            Sources::RandomAmong(n),
            limiter.program(),
            refs,
        )?;
        let known_floor = Driver::new(
            "rlb_known_pass",
            Sources::RandomAmong(n),
            refs.program(PASS),
            refs,
        )?;

        let (mut hot, mut known_ns, mut known_floor_ns, mut new_ns, mut new_floor_ns, mut floor) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
        );
        let hot_frame = v4_frame(tracked_addr(populated / 2, false));
        repeat_ns(limiter.program(), &hot_frame, 10)?;
        let floor_frame = v4_frame([198, 18, 0, 1]);
        let known_frame = v4_frame(tracked_addr(0, false));
        for _ in 0..opts.runs {
            crate::check_interrupted()?;
            floor.push(repeat_ns(refs.program(PASS), &floor_frame, opts.repeat)?.0 + TRUNCATION);
            hot.push(repeat_ns(limiter.program(), &hot_frame, opts.repeat)?.0 + TRUNCATION);
            known_floor_ns.push(known_floor.run(&known_frame, opts.repeat)?);
            known_ns.push(known.run(&known_frame, opts.repeat)?);
            let first = fresh_next;
            new_floor_ns
                .push(new_floor.run(&sequential_from(tracked_addr(first, true)), new_repeat)?);
            new_ns.push(grow.run(&sequential_from(tracked_addr(first, true)), new_repeat)?);
            fresh_next += opts.new_sources;
            // Take the new sources out again, so the population stays what it says.
            for i in first..fresh_next {
                let mut addr = [0u8; 16];
                addr[..4].copy_from_slice(&tracked_addr(i, true));
                let key = BucketKey {
                    rule: tracked,
                    family: 4,
                    _pad: [0; 3],
                    addr,
                };
                let _ = buckets.remove(&key);
            }
        }
        let detail = json!({
            "target_sources": target,
            "buckets_created_so_far": entries,
            "bucket_capacity": capacity,
            "populate_seconds": fill_secs,
            "new_sources_per_run": opts.new_sources,
        });
        let mut add = |key: String, label: String, runs: Vec<f64>, baseline: Option<String>| {
            report.add(Figure {
                key,
                section: SECTION_POP,
                label,
                unit: "ns/pkt",
                runs,
                baseline,
                detail: detail.clone(),
            });
        };
        let k = |what: &str| format!("kernel.pop.{tag}.{what}");
        add(k("floor"), format!("floor: XDP_PASS ({what})"), floor, None);
        add(
            k("hot"),
            format!("limiter: hot known source, {what}"),
            hot,
            Some(k("floor")),
        );
        add(
            k("known_floor"),
            format!("floor: random-known driver + XDP_PASS ({what})"),
            known_floor_ns,
            None,
        );
        add(
            k("known"),
            format!("limiter: random known source (driver), {what}"),
            known_ns,
            Some(k("known_floor")),
        );
        add(
            k("new_floor"),
            format!("floor: new-source driver + XDP_PASS ({what})"),
            new_floor_ns,
            None,
        );
        add(
            k("new"),
            format!("limiter: new source, first packet (driver), {what}"),
            new_ns,
            Some(k("new_floor")),
        );
    }
    Ok(())
}

const SECTION_PROBES: &str =
    "Where the time goes: probes doing one operation of the fast path, then XDP_PASS (BPF_PROG_TEST_RUN)";

fn pinned(limiter: &Limiter, name: &str) -> Result<MapData> {
    let path = limiter.tdp.pin_dir().join(name);
    MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))
}

/// Bytes of a plain-old-data key.
fn key_bytes<T: Copy>(key: &T) -> Vec<u8> {
    // SAFETY: `T` is one of the #[repr(C)] key types of ratelimit-common, without padding.
    unsafe {
        std::slice::from_raw_parts(
            std::ptr::from_ref(key).cast::<u8>(),
            std::mem::size_of::<T>(),
        )
        .to_vec()
    }
}

/// The prefix trie key the limiter looks up for IPv4 source `src` under `generation`.
fn prefix_key(generation: u32, src: [u8; 4]) -> Vec<u8> {
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&src);
    let mut key = (ratelimit_common::PREFIX_KEY_HEADER_BITS + 32)
        .to_ne_bytes()
        .to_vec();
    key.extend(key_bytes(&ratelimit_common::PrefixKey {
        generation: ratelimit_common::prefix_generation(generation),
        family: 4,
        addr,
    }));
    key
}

/// Probes: programs that do one operation of the limiter's fast path and pass, each measured
/// against the floor in the same run. `tag`/`what` say which rule set and population are in the
/// maps; `clocks` adds the two clock probes.
pub fn probes(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
    tag: &str,
    what: &str,
    clocks: bool,
) -> Result<()> {
    use std::os::fd::AsFd as _;
    crate::announce(&format!("probes of the fast path's parts ({what})"));
    let generation = limiter.tdp.maps().config()?.generation;
    let admit = limiter.id("admit")?;
    let prefixes = pinned(limiter, map_names::PREFIXES)?;
    let buckets = pinned(limiter, map_names::BUCKETS)?;
    let stats = pinned(limiter, map_names::GLOBAL_STATS)?;
    let rules = pinned(limiter, map_names::RULES)?;
    let hot_src = [198, 18, 0, 1];
    // Make sure the hot source's bucket exists.
    repeat_ns(limiter.program(), &v4_frame(hot_src), 10)?;
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&hot_src);
    let bucket_key = key_bytes(&BucketKey {
        rule: admit,
        family: 4,
        _pad: [0; 3],
        addr,
    });
    let prefix_key = prefix_key(generation, hot_src);
    let zero = 0u32.to_ne_bytes();
    let admit_key = admit.to_ne_bytes();
    let mut list: Vec<(String, String, Vec<progs::Insn>)> = Vec::new();
    if clocks {
        list.push((
            "clock".into(),
            "bpf_ktime_get_ns()".into(),
            progs::probe(Probe::Clock),
        ));
        list.push((
            "coarse_clock".into(),
            "bpf_ktime_get_coarse_ns()".into(),
            progs::probe(Probe::CoarseClock),
        ));
        list.push((
            "jiffies".into(),
            "bpf_jiffies64()".into(),
            progs::probe(Probe::Jiffies),
        ));
        list.push((
            "stats_lookup".into(),
            "per-CPU array lookup (global counters)".into(),
            progs::probe(Probe::Lookup(stats.fd().as_fd(), &zero)),
        ));
        list.push((
            "rule_lookup".into(),
            "array lookup (rule record)".into(),
            progs::probe(Probe::Lookup(rules.fd().as_fd(), &admit_key)),
        ));
    }
    list.push((
        format!("prefix_lookup.{tag}"),
        format!("prefix trie lookup, hit ({what})"),
        progs::probe(Probe::Lookup(prefixes.fd().as_fd(), &prefix_key)),
    ));
    list.push((
        format!("bucket_lookup.{tag}"),
        format!("bucket map (LRU hash) lookup, hit ({what})"),
        progs::probe(Probe::Lookup(buckets.fd().as_fd(), &bucket_key)),
    ));
    let programs: Vec<(String, String, Xdp)> = list
        .into_iter()
        .map(|(k, l, insns)| {
            Ok((
                k.clone(),
                l,
                progs::load(&format!("rlb_{}", k.replace('.', "_")), &insns, refs.dir())?,
            ))
        })
        .collect::<Result<_>>()?;
    let frame = v4_frame(hot_src);
    let floor_key = format!("kernel.probe_floor.{tag}");
    let mut floor = Vec::new();
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); programs.len()];
    for _ in 0..opts.runs {
        crate::check_interrupted()?;
        floor.push(repeat_ns(refs.program(PASS), &frame, opts.repeat)?.0 + TRUNCATION);
        for (i, (key, _, prog)) in programs.iter().enumerate() {
            let (ns, _, action) = repeat_ns(prog, &frame, opts.repeat)?;
            if action != 2 {
                bail!("probe {key} did not pass (its lookup missed?)");
            }
            runs[i].push(ns + TRUNCATION);
        }
    }
    report.add(Figure {
        key: floor_key.clone(),
        section: SECTION_PROBES,
        label: format!("floor: XDP_PASS ({what})"),
        unit: "ns/pkt",
        runs: floor,
        baseline: None,
        detail: json!({ "repeat": opts.repeat }),
    });
    for ((key, label, _), runs) in programs.into_iter().zip(runs) {
        report.add(Figure {
            key: format!("kernel.probe.{key}"),
            section: SECTION_PROBES,
            label,
            unit: "ns/pkt",
            runs,
            baseline: Some(floor_key.clone()),
            detail: json!({ "repeat": opts.repeat }),
        });
    }
    Ok(())
}

const SECTION_MAPS: &str =
    "Bucket map types, 1M entries, full (probes: one insert or lookup, then XDP_PASS)";

/// The bucket map's candidates side by side, outside the limiter: a map of 2^20 entries with the
/// limiter's key and value sizes is filled past capacity, then timed inserting a new source (an
/// LRU map evicts the least recently used entry; a plain hash map refuses, as nftables' dynamic
/// set does when full) and looking up a present one.
pub fn map_variants(report: &mut Report, opts: &Options, refs: &Refs) -> Result<()> {
    use std::os::fd::AsFd as _;
    let capacity = 1u32 << 20;
    let new_repeat = u32::try_from(opts.new_sources).context("--new-sources")?;
    let floor_driver = Driver::new(
        "rlb_seq_pass",
        Sources::Sequential,
        refs.program(PASS),
        refs,
    )?;
    for (tag, label, map_type, flags, key_size) in [
        (
            "lru",
            "LRU hash (as the bucket map)",
            progs::MAP_LRU_HASH,
            0,
            24,
        ),
        (
            "lru_no_common",
            "LRU hash, NO_COMMON_LRU",
            progs::MAP_LRU_HASH,
            progs::F_NO_COMMON_LRU,
            24,
        ),
        (
            "lru_key8",
            "LRU hash, 8-byte key (rule, IPv4)",
            progs::MAP_LRU_HASH,
            0,
            8,
        ),
        ("hash", "hash (full: inserts fail)", progs::MAP_HASH, 0, 24),
    ] {
        crate::check_interrupted()?;
        crate::announce(&format!("bucket map candidates: {label}"));
        let map = progs::create_map(map_type, key_size, 64, capacity, flags)?;
        let insert = progs::load(
            "rlb_insert",
            &progs::probe(Probe::InsertSource(map.as_fd())),
            refs.dir(),
        )?;
        let driver = Driver::new("rlb_seq_insert", Sources::Sequential, &insert, refs)?;
        // Fill past capacity, from 10.0.0.0 on.
        let filled = capacity + capacity / 8;
        driver.run(&sequential_from([10, 0, 0, 0]), filled)?;
        // A key that is there: an LRU map keeps the last ones inserted, a hash map the first.
        let present = if map_type == progs::MAP_HASH {
            0
        } else {
            filled - 1
        };
        let mut key = (u32::from_be_bytes([10, 0, 0, 0]) + present)
            .to_be_bytes()
            .to_vec();
        key.resize(key_size as usize, 0);
        let lookup = progs::load(
            "rlb_lookup",
            &progs::probe(Probe::Lookup(map.as_fd(), &key)),
            refs.dir(),
        )?;
        let frame = v4_frame([198, 18, 0, 1]);
        let (mut ins, mut ins_floor, mut look, mut floor) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut next = u32::from_be_bytes([10, 128, 0, 0]);
        for _ in 0..opts.runs {
            crate::check_interrupted()?;
            floor.push(repeat_ns(refs.program(PASS), &frame, opts.repeat)?.0 + TRUNCATION);
            let (ns, _, action) = repeat_ns(&lookup, &frame, opts.repeat)?;
            if action != 2 {
                bail!("{label}: a key that should be there is not");
            }
            look.push(ns + TRUNCATION);
            let start = sequential_from(next.to_be_bytes());
            ins_floor.push(floor_driver.run(&start, new_repeat)?);
            ins.push(driver.run(&start, new_repeat)?);
            next += new_repeat;
        }
        let k = |what: &str| format!("kernel.map.{tag}.{what}");
        let detail = json!({ "capacity": capacity, "filled_with": filled, "key_size": key_size, "value_size": 64 });
        for (key, label, runs, baseline) in [
            (
                k("floor"),
                format!("floor: XDP_PASS (next to {tag})"),
                floor,
                None,
            ),
            (
                k("lookup"),
                format!("{label}: lookup, hit"),
                look,
                Some(k("floor")),
            ),
            (
                k("insert_floor"),
                format!("floor: new-source driver + XDP_PASS ({tag})"),
                ins_floor,
                None,
            ),
            (
                k("insert"),
                format!("{label}: insert new source (driver)"),
                ins,
                Some(k("insert_floor")),
            ),
        ] {
            report.add(Figure {
                key,
                section: SECTION_MAPS,
                label,
                unit: "ns/pkt",
                runs,
                baseline,
                detail: detail.clone(),
            });
        }
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
        label: format!("kernel memory per tracked source ({entries} slots, preallocated)"),
        unit: "bytes",
        runs: vec![per],
        baseline: None,
        detail: json!({ "memlock_bytes": memlock, "max_entries": entries }),
    });
    Ok(())
}
