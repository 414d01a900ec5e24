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
    maps::MapData,
    programs::{TestRun as _, TestRunOptions, Xdp},
};
use ratelimit::{
    compile::{compile, CompiledRuleSet, RuleIds},
    config::{Config, RuleConfig},
    maps::store::Slot,
};
use ratelimit_common::{global, map_names, rule_flags, verdict, Bucket, BucketKey};
use ratelimit_testbed::{packet::eth, TestDataplane};
use serde_json::json;

use crate::{
    progs::{self, Probe, Sources, Touch},
    refs::{Refs, PASS},
    report::{Figure, Report},
    session::Options,
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
pub(crate) fn repeat_ns(prog: &Xdp, frame: &[u8], repeat: u32) -> Result<(f64, f64, u32)> {
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

pub(crate) fn v4_frame(src: [u8; 4]) -> Vec<u8> {
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
pub(crate) const TRUNCATION: f64 = 0.5;

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
        crate::session::check_interrupted()?;
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
            "kernel.limiter.ipv6_3ext",
            "limiter: IPv6 known source behind 3 extension headers, admitted",
            eth()
                .ipv6(
                    "2001:db8::1".parse().expect("address"),
                    "2001:db8::2".parse().expect("address"),
                )
                .ext(0, 0)
                .ext(43, 0)
                .ext(60, 0)
                .udp(40_000, 9)
                .pad_to(102)
                .build(),
        ),
        // A datagram's first fragment, then one of its others: the first looks its datagram up in
        // the fragment table (inserted by the warm-up), the other follows it.
        HotCase::new(
            "kernel.limiter.first_fragment",
            "limiter: IPv4 first fragment, admitted (fragment table lookup)",
            eth()
                .ipv4([198, 18, 0, 1].into(), [198, 18, 255, 254].into())
                .udp(40_000, 9)
                .frag(0, true)
                .ident(77)
                .pad_to(60)
                .build(),
        ),
        HotCase::new(
            "kernel.limiter.later_fragment",
            "limiter: IPv4 later fragment, admitted (follows its first)",
            eth()
                .ipv4([198, 18, 0, 1].into(), [198, 18, 255, 254].into())
                .proto(17)
                .payload(26)
                .frag(3, false)
                .ident(77)
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
    crate::session::announce("in-kernel cost: floor and limiter, hot frames");
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

/// Rules for [`hot_tcp_flags`]: a port rule, a protocol rule, and a SYN rule beside a protocol
/// rule, each on its own /24, all admitting everything.
pub const TCP_RULES: &str = r#"
[[rule]]
name = "tcp-port"
source = "198.18.4.0/24"
protocol = "tcp"
dst_port = 443
rate = 1000000000
burst = 1000000000

[[rule]]
name = "tcp-syn"
source = "198.18.5.0/24"
protocol = "tcp"
tcp_flags = "syn"
rate = 1000000000
burst = 1000000000

[[rule]]
name = "tcp-beside-syn"
source = "198.18.5.0/24"
protocol = "tcp"
rate = 1000000000
burst = 1000000000

[[rule]]
name = "tcp-any-flags"
source = "198.18.6.0/24"
protocol = "tcp"
rate = 1000000000
burst = 1000000000
"#;

/// Rules for [`hot_limits`]: one, two and three limits (per source; + per /24; + per rule), each
/// rule on its own /24, all admitting everything (on the coarse clock, as a one-limit rule).
pub const LIMIT_RULES: &str = r#"
[[rule]]
name = "limits-1"
source = "198.18.7.0/24"
rate = 1000000000
burst = 1000000000

[[rule]]
name = "limits-2"
source = "198.18.8.0/24"
rate = 1000000000
burst = 1000000000
[[rule.limit]]
per = "/24"
rate = 1000000000
burst = 1000000000

[[rule]]
name = "limits-3"
source = "198.18.9.0/24"
rate = 1000000000
burst = 1000000000
[[rule.limit]]
per = "/24"
rate = 1000000000
burst = 1000000000
[[rule.limit]]
per = "rule"
rate = 1000000000
burst = 1000000000
"#;

/// The cost of several limits per rule: a known source's admitted packet under a rule with one,
/// two and three limits (each extra limit is one more bucket charge). Expects [`LIMIT_RULES`]
/// installed.
pub fn hot_limits(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
) -> Result<()> {
    crate::session::announce("in-kernel cost: rules with 1, 2 and 3 limits");
    for (name, n) in [("limits-1", 1), ("limits-2", 2), ("limits-3", 3)] {
        let rule = limiter
            .set
            .rule(limiter.id(name)?)
            .context("rule in set")?
            .rule;
        if rule.limits() != n || rule.flags & rule_flags::COARSE_CLOCK == 0 {
            bail!("rule {name}: expected {n} limits on the coarse clock");
        }
    }
    let mut cases = vec![
        HotCase::new(
            "kernel.limiter.limits_1",
            "limits: known source, admitted, rule with 1 limit",
            v4_frame([198, 18, 7, 1]),
        ),
        HotCase::new(
            "kernel.limiter.limits_2",
            "limits: known source, admitted, 2 limits (+ per /24)",
            v4_frame([198, 18, 8, 1]),
        ),
        HotCase::new(
            "kernel.limiter.limits_3",
            "limits: known source, admitted, 3 limits (+ /24 + rule)",
            v4_frame([198, 18, 9, 1]),
        ),
    ];
    measure_hot(
        report,
        opts,
        refs,
        limiter,
        "kernel.floor_limits",
        &mut cases,
    )?;
    if let Some(f) = report
        .figures
        .iter_mut()
        .find(|f| f.key == "kernel.floor_limits")
    {
        f.label = "floor: XDP_PASS, re-measured next to the limits cases".into();
    }
    Ok(())
}

fn tcp_frame(src: [u8; 4], flags: u8) -> Vec<u8> {
    eth()
        .ipv4(src.into(), [198, 18, 255, 254].into())
        .tcp(40_000, 443)
        .tcp_flags(flags)
        .pad_to(60)
        .build()
}

/// The cost of classifying by TCP flags: a SYN under a SYN rule, and an ACK from a source whose
/// prefix has one (the walk tries the SYN rule first), against a port rule and a protocol rule.
/// Expects [`TCP_RULES`] installed.
pub fn hot_tcp_flags(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
) -> Result<()> {
    crate::session::announce("in-kernel cost: TCP port, protocol and SYN rules");
    let mut cases = vec![
        HotCase::new(
            "kernel.limiter.tcp_port_rule",
            "TCP: SYN under a protocol+port rule, admitted",
            tcp_frame([198, 18, 4, 1], 0x02),
        ),
        HotCase::new(
            "kernel.limiter.tcp_protocol_rule",
            "TCP: ACK under a protocol rule (no flag rule for the source), admitted",
            tcp_frame([198, 18, 6, 1], 0x10),
        ),
        HotCase::new(
            "kernel.limiter.syn_rule",
            "TCP: SYN under a tcp_flags = \"syn\" rule, admitted",
            tcp_frame([198, 18, 5, 1], 0x02),
        ),
        HotCase::new(
            "kernel.limiter.syn_rule_ack",
            "TCP: ACK past a SYN rule to its prefix's protocol rule, admitted",
            tcp_frame([198, 18, 5, 2], 0x10),
        ),
    ];
    measure_hot(report, opts, refs, limiter, "kernel.floor_tcp", &mut cases)?;
    if let Some(f) = report
        .figures
        .iter_mut()
        .find(|f| f.key == "kernel.floor_tcp")
    {
        f.label = "floor: XDP_PASS, re-measured next to the TCP cases".into();
    }
    Ok(())
}

/// Rules for [`layered_flood`]: a per-source limit and a per-rule one, in both orders, on two
/// prefixes of 10.0.0.0/8 (each a /16 of the IPv4 table); the per-rule limits admit next to
/// nothing, as under a flood that exhausted them.
pub const LAYERED_RULES: &str = r#"
[[rule]]
name = "per-source-first"
source = "10.0.0.0/9"
rate = 1000
burst = 2000
per = "source"

[[rule.limit]]
per = "rule"
rate = 1
burst = 1

[[rule]]
name = "per-rule-first"
source = "10.128.0.0/9"
rate = 1
burst = 1
per = "rule"

[[rule.limit]]
per = "source"
rate = 1000
burst = 2000
"#;

/// The in-kernel cost of a random-source flood's packet under a rule with a per-source and a
/// per-rule limit whose per-rule limit has no token left (#16's layered policy): every packet
/// comes from a new source (the sequential driver), misses the classification cache, and is
/// dropped by the per-rule limit's drop window. Against the same driver tail-calling XDP_PASS.
/// The end-to-end figure (`e2e.random.limiter_aggregate`) adds the pipeline around it.
pub fn layered_flood(report: &mut Report, opts: &Options, refs: &Refs) -> Result<()> {
    crate::session::announce(
        "in-kernel cost: a random-source flood under an exhausted per-rule limit",
    );
    let limiter = Limiter::new("bench_layered", IN_CACHE_BUCKETS, LAYERED_RULES)?;
    let lim = Driver::new("rlb_lay_lim", Sources::Sequential, limiter.program(), refs)?;
    let floor = Driver::new(
        "rlb_lay_pass",
        Sources::Sequential,
        refs.program(PASS),
        refs,
    )?;
    let counter = |c: usize| limiter.tdp.global().counters[c];
    let mut add = |key: &str, label: &str, runs: Vec<f64>, baseline: Option<&str>, detail| {
        report.add(Figure {
            key: key.into(),
            section: SECTION,
            label: label.into(),
            unit: "ns/pkt",
            runs,
            baseline: baseline.map(Into::into),
            detail,
        });
    };
    // The floor's runs beside each case's.
    let (mut floor_ns, mut cases) = (Vec::new(), Vec::new());
    // (rule, the second byte its sources start from: 10.0.0.0/9 and 10.128.0.0/9)
    for (tag, first) in [("per_source_first", 0u8), ("per_rule_first", 128)] {
        let rule = limiter.id(&tag.replace('_', "-"))?;
        // Exhaust the per-rule limit (its one token), then measure.
        lim.run(&sequential_from([10, first, 0, 0]), 10)?;
        let (mut runs, mut created) = (Vec::new(), 0);
        for run in 0..opts.runs {
            crate::session::check_interrupted()?;
            let from = [10, first + 1 + run as u8, 0, 0];
            floor_ns.push(floor.run(&sequential_from(from), opts.repeat)?);
            let before = counter(global::NEW_BUCKETS);
            runs.push(lim.run(&sequential_from(from), opts.repeat)?);
            created += counter(global::NEW_BUCKETS) - before;
        }
        let stats = limiter.tdp.rule(rule);
        let detail = json!({
            "rule": tag,
            "new_buckets_per_run": created / opts.runs as u64,
            "passed": stats.pkts[verdict::PASSED],
            "dropped_rate": stats.pkts[verdict::DROPPED_RATE],
        });
        cases.push((tag, runs, detail));
    }
    add(
        "kernel.layered.floor",
        "floor: new-source driver + XDP_PASS (layered flood)",
        floor_ns,
        None,
        json!({}),
    );
    for (tag, runs, detail) in cases {
        add(
            &format!("kernel.layered.{tag}"),
            &format!(
                "limiter: random-source flood, per-rule limit exhausted, {} (driver)",
                tag.replace('_', " ")
            ),
            runs,
            Some("kernel.layered.floor"),
            detail,
        );
    }
    Ok(())
}

/// A driver ([`progs::driver`]) that tail-calls `target`, with the program array it needs.
pub(crate) struct Driver {
    program: Xdp,
    _array: std::os::fd::OwnedFd,
}

impl Driver {
    fn new(name: &str, sources: Sources<'_>, target: &Xdp, refs: &Refs) -> Result<Self> {
        Self::touching(name, sources, None, target, refs)
    }

    /// A driver that reads records of the bucket store first (see [`progs::driver`]).
    pub(crate) fn touching(
        name: &str,
        sources: Sources<'_>,
        touch: Option<Touch<'_>>,
        target: &Xdp,
        refs: &Refs,
    ) -> Result<Self> {
        use std::os::fd::AsFd as _;
        let array = progs::prog_array(target)?;
        let program = progs::load(
            name,
            &progs::driver(sources, touch, array.as_fd()),
            refs.dir(),
        )?;
        Ok(Self {
            program,
            _array: array,
        })
    }

    /// Runs `frame` `repeat` times; the kernel's ns per run. Fails if the tail call failed.
    pub(crate) fn run(&self, frame: &[u8], repeat: u32) -> Result<f64> {
        let (k, _, action) = repeat_ns(&self.program, frame, repeat)?;
        if action == 0 {
            bail!("the driver's tail call failed (XDP_ABORTED)");
        }
        Ok(k + TRUNCATION)
    }
}

/// Runs `n` sources from `first` on through the limiter, one packet each (a source's first
/// packet creates its bucket); returns how many buckets that created.
pub fn fill(limiter: &Limiter, refs: &Refs, first: [u8; 4], n: u32) -> Result<u64> {
    let before = limiter.tdp.global().counters[global::NEW_BUCKETS];
    let driver = Driver::new("rlb_fill", Sources::Sequential, limiter.program(), refs)?;
    let mut left = n;
    let mut from = first;
    while left > 0 {
        crate::session::check_interrupted()?;
        let chunk = left.min(1 << 20);
        driver.run(&sequential_from(from), chunk)?;
        from = (u32::from_be_bytes(from) + chunk).to_be_bytes();
        left -= chunk;
    }
    Ok(limiter.tdp.global().counters[global::NEW_BUCKETS] - before)
}

/// A frame whose source is `first - 1`, for a [`Sources::Sequential`] driver to start at `first`.
pub(crate) fn sequential_from(first: [u8; 4]) -> Vec<u8> {
    v4_frame((u32::from_be_bytes(first).wrapping_sub(1)).to_be_bytes())
}

/// Live buckets of rule `rule` in the store: `(tracked population, never-seen sources)`, i.e.
/// addresses in 10.0.0.0/9 and in 10.128.0.0/9 (see [`tracked_addr`]).
fn census(limiter: &Limiter, rule: u32) -> Result<(u64, u64)> {
    let (mut population, mut fresh) = (0, 0);
    limiter.tdp.maps().for_each_bucket(|_, b| {
        if u32::from(b.rule) == rule && b.family == 4 && b.addr[0] == 10 {
            if b.addr[1] & 0x80 == 0 {
                population += 1;
            } else {
                fresh += 1;
            }
        }
    })?;
    Ok((population, fresh))
}

/// The addresses of the tracked population of rule `rule` that hold a bucket now.
fn population_addrs(limiter: &Limiter, rule: u32) -> Result<Vec<[u8; 4]>> {
    let mut addrs = Vec::new();
    limiter.tdp.maps().for_each_bucket(|_, b| {
        if u32::from(b.rule) == rule && b.family == 4 && b.addr[0] == 10 && b.addr[1] & 0x80 == 0 {
            addrs.push([b.addr[0], b.addr[1], b.addr[2], b.addr[3]]);
        }
    })?;
    Ok(addrs)
}

/// Frees the records of never-seen sources `first..end` (see [`tracked_addr`]) that hold a
/// bucket, as an empty record (the program takes those first); returns how many it freed.
fn free_fresh(limiter: &Limiter, rule: u32, first: usize, end: usize) -> Result<u64> {
    let maps = limiter.tdp.maps();
    let mut freed = 0;
    for i in first..end {
        let mut addr = [0u8; 16];
        addr[..4].copy_from_slice(&tracked_addr(i, true));
        let key = BucketKey {
            rule,
            family: 4,
            _pad: [0; 3],
            addr,
        };
        if let (Slot::Found(index), _) = maps.locate_bucket(&key, 0)? {
            let old = maps.store().get(index).header();
            if maps.store().install(index, old, &Bucket::default()) {
                freed += 1;
            }
        }
    }
    Ok(freed)
}

/// Puts back the buckets of `addrs` (rule `rule`) that are no longer in the store, as full
/// buckets written the way the program writes a new one (into the record it would take);
/// returns how many it put back.
fn restore(limiter: &Limiter, rule: u32, addrs: &[[u8; 4]]) -> Result<u64> {
    let maps = limiter.tdp.maps();
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write to.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &raw mut ts) };
    let now = u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000
        + u64::try_from(ts.tv_nsec).unwrap_or(0);
    let mut restored = 0;
    for a in addrs {
        let mut addr = [0u8; 16];
        addr[..4].copy_from_slice(a);
        let key = BucketKey {
            rule,
            family: 4,
            _pad: [0; 3],
            addr,
        };
        if let (Slot::Vacant { index, header, .. }, gen) = maps.locate_bucket(&key, now)? {
            let fresh = Bucket {
                addr,
                rule: u16::try_from(rule).context("rule id")?,
                family: 4,
                state: 0,
                rule_gen: gen,
                created_share: Bucket::created_at(now),
                ..Bucket::default()
            };
            if maps.store().install(index, header, &fresh) {
                restored += 1;
            }
        }
    }
    Ok(restored)
}

/// Grows the tracked population of rule `tracked` (sources from 10.0.0.0 on, one packet each)
/// until the store holds `target` of them, sending at most `limit` sources in all; `sent` is how
/// many were sent so far and is advanced. Returns the population's live buckets.
fn grow(
    limiter: &Limiter,
    refs: &Refs,
    tracked: u32,
    sent: &mut usize,
    target: u64,
    limit: usize,
) -> Result<u64> {
    loop {
        let (population, _) = census(limiter, tracked)?;
        if population >= target || *sent >= limit {
            return Ok(population);
        }
        // At least 1/64 of the gap's worth at a time: near capacity most new sources take the
        // record of another (every set of the source full), so the count creeps up.
        let want = usize::try_from(target - population)
            .unwrap_or(usize::MAX)
            .max(usize::try_from(target / 64).unwrap_or(0))
            .max(1)
            .min(limit - *sent);
        fill(
            limiter,
            refs,
            tracked_addr(*sent, false),
            u32::try_from(want).context("population")?,
        )?;
        *sent += want;
    }
}

/// Records of the store for [`populations`]' `in_cache` case: 4 MiB (1,024 pages), so the
/// records a new source's packet reads can stay in the CPU's last-level cache, and its pages
/// mostly in the TLB, where in the default store (64 MiB, 16,384 pages) they are in neither. The
/// same 1k population and the same new sources (each run's 20,000 fit without evicting any, so
/// the program takes the same path as with the default store): the difference between the two
/// stores' new-source figures is what the memory beyond the last-level cache costs. (A store of
/// 8,192 records, all in L2, measured lower still, but there each run's new sources evict one
/// another: another path.)
pub const IN_CACHE_BUCKETS: u32 = 65_536;

/// Tracked-source populations: the hot path, a random known source and a new source, with the
/// bucket store holding each population in turn (grown by running frames through the program,
/// one per source, until `bucket_count` says the store holds it).
///
/// New and random known sources come from drivers that rewrite the frame's source on every run
/// and tail-calls the limiter; the same drivers tail-calling `bench_pass` are their floors. The
/// new sources' buckets are freed again after each run, and sources they pushed out are sent
/// again, so that the population stays what it says.
///
/// With `in_cache`, one population only (1k), in a store of [`IN_CACHE_BUCKETS`] records (see
/// there): tagged `cache`.
///
/// Returns the buckets the store tracked once the last population was grown.
#[expect(clippy::too_many_lines, reason = "one measurement, step by step")]
pub fn populations(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
    in_cache: bool,
) -> Result<u64> {
    use std::os::fd::AsFd as _;
    let tracked = limiter.id("tracked")?;
    let capacity = limiter.tdp.maps().bucket_capacity()?;
    // Measures new sources (the next addresses after a start): each one's first packet.
    let new_lim = Driver::new("rlb_seq_lim", Sources::Sequential, limiter.program(), refs)?;
    // Its floors: the same driver tail-calling XDP_PASS, and the memory floors (the driver
    // reading one random record of the store, or the 8 records of two sets, before it passes).
    let buckets = pinned(limiter, map_names::BUCKETS)?;
    let record = Some(Touch::Record(buckets.fd().as_fd(), capacity));
    let candidates = Some(Touch::Candidates(buckets.fd().as_fd(), capacity));
    let new_pass = |name: &str, touch: Option<Touch<'_>>| {
        Driver::touching(name, Sources::Sequential, touch, refs.program(PASS), refs)
    };
    let new_floor = new_pass("rlb_seq_pass", None)?;
    let memory_floor = new_pass("rlb_seq_mem", record)?;
    let candidates_floor = new_pass("rlb_seq_mem8", candidates)?;
    // Opt-in (`--paged-floors`): the same two floors on a store of kmalloc'ed pages.
    let paged = if opts.paged_floors {
        Some(progs::PagedStore::new(capacity)?)
    } else {
        None
    };
    let paged_floors = match &paged {
        Some(paged) => Some((
            new_pass(
                "rlb_seq_pmem",
                Some(Touch::PagedRecord(paged.outer.as_fd(), paged.pages)),
            )?,
            new_pass(
                "rlb_seq_pmem8",
                Some(Touch::PagedCandidates(paged.outer.as_fd(), paged.pages)),
            )?,
        )),
        None => None,
    };
    let mut sent = 0usize;
    let mut fresh_next = 0usize;
    let cap = capacity as usize;
    // (population wanted, most sources sent to get it, tag, label)
    let mut steps: Vec<(u64, usize, &str, &str)> = if in_cache {
        vec![(
            1_000,
            1_000 * 2,
            "cache",
            "1k tracked, a store of 65,536 records (4 MiB)",
        )]
    } else {
        vec![
            (1_000, 1_000 * 2, "1k", "1k tracked"),
            (100_000, 100_000 * 2, "100k", "100k tracked"),
            (1_000_000, cap * 3 / 2, "1m", "1M tracked"),
            // Full: every record holding a source. Near the end a new source finds a free
            // record only when one of its 16 candidates is free (the others recycle refilled
            // buckets), so the last free records take a few million sources to find.
            (u64::from(capacity), cap * 4, "full", "store full, evicting"),
        ]
    };
    if opts.quick {
        steps.truncate(2);
    }
    let mut last = 0;
    let new_repeat = u32::try_from(opts.new_sources).context("--new-sources")?;
    for (target, limit, tag, what) in steps {
        crate::session::check_interrupted()?;
        crate::session::announce(&format!(
            "in-kernel cost with {what} (populating to {target} buckets)"
        ));
        let start = Instant::now();
        let population = grow(limiter, refs, tracked, &mut sent, target, limit)?;
        let fill_secs = start.elapsed().as_secs_f64();
        let count = limiter.tdp.maps().bucket_count()?;
        eprintln!(
            "    {what}: {population} buckets of the population ({sent} sources sent), \
             {count} buckets tracked in all, capacity {capacity}"
        );
        if tag != "full" && population < target {
            bail!("{what}: the store holds only {population} of {target} buckets after {sent} sources");
        }
        // Random known sources are drawn from the addresses that hold a bucket now.
        let addrs = population_addrs(limiter, tracked)?;
        let n = u32::try_from(addrs.len()).context("population")?;
        let addr_array = progs::u32_array(&addrs)?;
        let known = Driver::new(
            "rlb_known_lim",
            Sources::RandomOf(addr_array.as_fd(), n),
            limiter.program(),
            refs,
        )?;
        // Its floors: the same driver tail-calling XDP_PASS, touching the store or not.
        let known_pass = |name: &str, touch: Option<Touch<'_>>| {
            let sources = Sources::RandomOf(addr_array.as_fd(), n);
            Driver::touching(name, sources, touch, refs.program(PASS), refs)
        };
        let known_floor = known_pass("rlb_known_pass", None)?;
        let known_memory_floor = known_pass("rlb_known_mem", record)?;
        let known_candidates_floor = known_pass("rlb_known_mem8", candidates)?;

        let (mut memory_floor_ns, mut candidates_floor_ns) = (Vec::new(), Vec::new());
        let (mut paged_floor_ns, mut paged_candidates_floor_ns) = (Vec::new(), Vec::new());
        let (mut known_memory_floor_ns, mut known_candidates_floor_ns) = (Vec::new(), Vec::new());
        let (mut hot, mut known_ns, mut known_floor_ns, mut new_ns, mut new_floor_ns, mut floor) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
        );
        let (mut known_misses, mut new_created, mut evicted_full, mut evicted_lost, mut resent) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        let mut population_min = population;
        let hot_frame = v4_frame(addrs[addrs.len() / 2]);
        repeat_ns(limiter.program(), &hot_frame, 10)?;
        let floor_frame = v4_frame([198, 18, 0, 1]);
        let known_frame = v4_frame(tracked_addr(0, false));
        let counter = |i: usize| limiter.tdp.global().counters[i];
        for _ in 0..opts.runs {
            crate::session::check_interrupted()?;
            floor.push(repeat_ns(refs.program(PASS), &floor_frame, opts.repeat)?.0 + TRUNCATION);
            hot.push(repeat_ns(limiter.program(), &hot_frame, opts.repeat)?.0 + TRUNCATION);
            known_floor_ns.push(known_floor.run(&known_frame, opts.repeat)?);
            known_memory_floor_ns.push(known_memory_floor.run(&known_frame, opts.repeat)?);
            known_candidates_floor_ns.push(known_candidates_floor.run(&known_frame, opts.repeat)?);
            let created = counter(global::NEW_BUCKETS);
            known_ns.push(known.run(&known_frame, opts.repeat)?);
            known_misses += counter(global::NEW_BUCKETS) - created;
            let first = fresh_next;
            // The frame every new-source driver of this run starts from.
            let fresh = sequential_from(tracked_addr(first, true));
            new_floor_ns.push(new_floor.run(&fresh, new_repeat)?);
            memory_floor_ns.push(memory_floor.run(&fresh, new_repeat)?);
            candidates_floor_ns.push(candidates_floor.run(&fresh, new_repeat)?);
            if let Some((one, eight)) = &paged_floors {
                paged_floor_ns.push(one.run(&fresh, new_repeat)?);
                paged_candidates_floor_ns.push(eight.run(&fresh, new_repeat)?);
            }
            let (created, full, lost) = (
                counter(global::NEW_BUCKETS),
                counter(global::EVICTED_FULL),
                counter(global::EVICTED_LOST),
            );
            new_ns.push(new_lim.run(&fresh, new_repeat)?);
            new_created += counter(global::NEW_BUCKETS) - created;
            evicted_full += counter(global::EVICTED_FULL) - full;
            evicted_lost += counter(global::EVICTED_LOST) - lost;
            fresh_next += opts.new_sources;
            // Take the new sources out again, and put back the population they pushed out.
            free_fresh(limiter, tracked, first, fresh_next)?;
            let (now, _) = census(limiter, tracked)?;
            population_min = population_min.min(now);
            if now < population {
                resent += restore(limiter, tracked, &addrs)?;
            }
        }
        let (population_end, fresh_left) = census(limiter, tracked)?;
        let count_end = limiter.tdp.maps().bucket_count()?;
        // What the store tracked once filled (the runs above free their new sources' records
        // again, so it ends a little below).
        last = count;
        let runs = opts.runs as u64;
        let detail = json!({
            "target_buckets": target,
            "sources_sent": sent,
            "population_buckets": population,
            "population_buckets_min_between_runs": population_min,
            "population_buckets_end": population_end,
            "tracked_buckets": count,
            "tracked_buckets_end": count_end,
            "new_sources_left_end": fresh_left,
            "bucket_capacity": capacity,
            "populate_seconds": fill_secs,
            "random_known_among": n,
            "random_known_new_buckets_per_run": known_misses / runs,
            "new_sources_per_run": opts.new_sources,
            "new_buckets_per_new_run": new_created / runs,
            "evicted_full_per_new_run": evicted_full / runs,
            "evicted_lost_per_new_run": evicted_lost / runs,
            "population_resent_buckets": resent,
        });
        eprintln!(
            "    {what}: random known: {} of {} runs created a bucket per run (pushed out by the \
             previous run's new sources); new sources: {} buckets created, {} refilled and {} \
             in-debt buckets evicted per run",
            known_misses / runs,
            opts.repeat,
            new_created / runs,
            evicted_full / runs,
            evicted_lost / runs
        );
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
        let what = format!("{what}, {count} in store");
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
        for (key, driver, runs, floor) in [
            (
                "known_memory_floor",
                "random-known driver reading one random record of the store",
                known_memory_floor_ns,
                "known_floor",
            ),
            (
                "known_candidates_floor",
                "random-known driver reading the 8 records of two random sets of a page",
                known_candidates_floor_ns,
                "known_floor",
            ),
            (
                "new_memory_floor",
                "new-source driver reading one random record of the store",
                memory_floor_ns,
                "new_floor",
            ),
            (
                "new_candidates_floor",
                "new-source driver reading the 8 records of a key's two sets",
                candidates_floor_ns,
                "new_floor",
            ),
            (
                "new_paged_memory_floor",
                "new-source driver reading one random record of a store on kmalloc'ed pages",
                paged_floor_ns,
                "new_floor",
            ),
            (
                "new_paged_candidates_floor",
                "new-source driver reading the 8 records of two sets of a store on kmalloc'ed pages",
                paged_candidates_floor_ns,
                "new_floor",
            ),
        ] {
            if runs.is_empty() {
                continue;
            }
            add(
                k(key),
                format!("memory: {driver} ({what})"),
                runs,
                Some(k(floor)),
            );
        }
    }
    Ok(last)
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
    crate::session::announce(&format!("probes of the fast path's parts ({what})"));
    let generation = limiter.tdp.maps().config()?.generation;
    let admit = limiter.id("admit")?;
    let prefixes = pinned(limiter, map_names::PREFIXES)?;
    let buckets = pinned(limiter, map_names::BUCKETS)?;
    let stats = pinned(limiter, map_names::GLOBAL_STATS)?;
    let rules = pinned(limiter, map_names::RULES)?;
    let hot_src = [198, 18, 0, 1];
    // Make sure the hot source's bucket exists, and find its record.
    repeat_ns(limiter.program(), &v4_frame(hot_src), 10)?;
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&hot_src);
    let key = BucketKey {
        rule: admit,
        family: 4,
        _pad: [0; 3],
        addr,
    };
    let (Slot::Found(record), _) = limiter.tdp.maps().locate_bucket(&key, 0)? else {
        bail!("the hot source has no bucket in the store");
    };
    let record_key = record.to_ne_bytes();
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
        format!("bucket_record.{tag}"),
        format!("bucket store: array lookup of the record ({what})"),
        progs::probe(Probe::Lookup(buckets.fd().as_fd(), &record_key)),
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
        crate::session::check_interrupted()?;
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

/// Records of the second, small bucket store [`memory`] loads to tell the store's fixed part
/// from what each record costs.
const SMALL_STORE: u32 = 65_536;

/// Kernel memory of the bucket store: its `memlock` over its records, and over the buckets it
/// tracks (`tracked`, counted with the store full; `None` when it was not filled in this run).
///
/// `memlock` holds a fixed part (the map's header, rounded to pages) beside the records, so the
/// per-source figure is the *marginal* cost: a second program is loaded with a store of
/// [`SMALL_STORE`] records, and the slope between the two stores' `memlock` (bytes per record)
/// is spread over the sources tracked. The fixed part and `memlock / tracked` are in the detail.
pub fn memory(report: &mut Report, limiter: &Limiter, tracked: Option<u64>) -> Result<()> {
    let (memlock, entries) = map_memory(limiter, map_names::BUCKETS)?;
    #[expect(clippy::cast_precision_loss, reason = "bytes")]
    let per = |n: u64| memlock as f64 / n as f64;
    report.add(Figure {
        key: "memory.kernel_per_record".into(),
        section: "Memory and control plane",
        label: format!("kernel memory per record of the bucket store ({entries} records)"),
        unit: "bytes",
        runs: vec![per(entries)],
        baseline: None,
        detail: json!({ "memlock_bytes": memlock, "max_entries": entries }),
    });
    if let Some(tracked) = tracked.filter(|&t| t > 0) {
        let small = Limiter::new("bench-mem", SMALL_STORE, BASE_RULES)?;
        let (small_memlock, small_entries) = map_memory(&small, map_names::BUCKETS)?;
        drop(small);
        anyhow::ensure!(
            entries > small_entries && memlock > small_memlock,
            "the bucket store of {entries} records ({memlock} B) is not larger than the one of \
             {small_entries} ({small_memlock} B)"
        );
        #[expect(clippy::cast_precision_loss, reason = "bytes")]
        let slope = (memlock - small_memlock) as f64 / (entries - small_entries) as f64;
        #[expect(clippy::cast_precision_loss, reason = "bytes")]
        let fixed = memlock as f64 - slope * entries as f64;
        #[expect(clippy::cast_precision_loss, reason = "bytes")]
        let marginal = slope * entries as f64 / tracked as f64;
        report.add(Figure {
            key: "memory.kernel_per_tracked_source".into(),
            section: "Memory and control plane",
            label: format!(
                "kernel memory per tracked source ({tracked} tracked, store full; the slope \
                 between stores of {small_entries} and {entries} records)"
            ),
            unit: "bytes",
            runs: vec![marginal],
            baseline: None,
            detail: json!({
                "memlock_bytes": memlock,
                "max_entries": entries,
                "tracked_buckets": tracked,
                "small_memlock_bytes": small_memlock,
                "small_max_entries": small_entries,
                "bytes_per_record": slope,
                "fixed_bytes": fixed,
                "memlock_per_tracked": per(tracked),
            }),
        });
    }
    Ok(())
}

const SECTION_CPUS: &str =
    "One hot source charged from every CPU at once (BPF_PROG_TEST_RUN, a thread pinned to each CPU)";

/// How the cost of one hot source grows with CPUs: the admitted and the dropped hot frames run
/// on one CPU alone, then on every CPU at once (a thread pinned to each, started together, each
/// a BPF_PROG_TEST_RUN of `repeat` runs of the same frame: the same bucket from every CPU).
/// Reports the kernel's ns per packet on each CPU (the mean of the CPUs) against one CPU alone.
pub fn cpus(report: &mut Report, opts: &Options, limiter: &Limiter) -> Result<()> {
    let n = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    if n < 2 {
        crate::session::announce("one CPU only: no figure for the cost on several CPUs");
        return Ok(());
    }
    crate::session::announce(&format!(
        "in-kernel cost of one hot source on {n} CPUs at once"
    ));
    let prog = limiter.program();
    // The kernel's ns per run, and when the call started and ended.
    let run_on =
        |cpu: usize, frame: &[u8], start: &std::sync::Barrier| -> Result<(f64, Instant, Instant)> {
            ratelimit_testbed::xdp::pin_to_cpu(cpu)
                .with_context(|| format!("pinning to CPU {cpu}"))?;
            start.wait();
            let t0 = Instant::now();
            let ns = repeat_ns(prog, frame, opts.repeat)?.0 + TRUNCATION;
            Ok((ns, t0, Instant::now()))
        };
    for (tag, what, frame) in [
        (
            "admitted",
            "known source, admitted",
            v4_frame([198, 18, 0, 1]),
        ),
        (
            "dropped",
            "known source, dropped",
            v4_frame([198, 18, 2, 1]),
        ),
    ] {
        repeat_ns(prog, &frame, 1000)?;
        let (mut one, mut all, mut each, mut overlaps) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..opts.runs {
            crate::session::check_interrupted()?;
            let alone = std::sync::Barrier::new(1);
            one.push(
                std::thread::scope(|s| {
                    s.spawn(|| run_on(0, &frame, &alone))
                        .join()
                        .map_err(|_| anyhow::anyhow!("a test-run thread panicked"))?
                })?
                .0,
            );
            let together = std::sync::Barrier::new(n);
            let per_cpu = std::thread::scope(|s| {
                let threads: Vec<_> = (0..n)
                    .map(|cpu| {
                        let (frame, together) = (&frame, &together);
                        s.spawn(move || run_on(cpu, frame, together))
                    })
                    .collect();
                threads
                    .into_iter()
                    .map(|t| {
                        t.join()
                            .map_err(|_| anyhow::anyhow!("a test-run thread panicked"))?
                    })
                    .collect::<Result<Vec<(f64, Instant, Instant)>>>()
            })?;
            // How much of the longest call ran while every call ran (1: fully at once).
            let first_end = per_cpu.iter().map(|r| r.2).min().expect("threads");
            let last_start = per_cpu.iter().map(|r| r.1).max().expect("threads");
            let longest = per_cpu
                .iter()
                .map(|r| (r.2 - r.1).as_secs_f64())
                .fold(0.0, f64::max);
            overlaps.push(
                first_end
                    .checked_duration_since(last_start)
                    .map_or(0.0, |d| d.as_secs_f64() / longest.max(1e-9)),
            );
            let per_cpu: Vec<f64> = per_cpu.iter().map(|r| r.0).collect();
            #[expect(clippy::cast_precision_loss, reason = "a few CPUs")]
            all.push(per_cpu.iter().sum::<f64>() / n as f64);
            each.push(per_cpu);
        }
        eprintln!(
            "    {what}: calls overlapped {:.0}% (median of runs)",
            crate::report::median(&overlaps) * 100.0
        );
        let one_key = format!("kernel.cpus.{tag}.one");
        report.add(Figure {
            key: one_key.clone(),
            section: SECTION_CPUS,
            label: format!("{what}: one CPU alone (CPU 0)"),
            unit: "ns/pkt",
            runs: one,
            baseline: None,
            detail: json!({ "repeat": opts.repeat }),
        });
        report.add(Figure {
            key: format!("kernel.cpus.{tag}.all"),
            section: SECTION_CPUS,
            label: format!("{what}: {n} CPUs at once, per CPU (mean)"),
            unit: "ns/pkt",
            runs: all,
            baseline: Some(one_key),
            detail: json!({
                "repeat": opts.repeat,
                "cpus": n,
                "ns_per_cpu": each,
                "overlap": overlaps,
            }),
        });
    }
    Ok(())
}

/// The bench-only build of the XDP program without the handling of cut packets (ratelimit-ebpf's
/// feature `bench-without-cut`: every packet classified as a whole one, no fragment table, no
/// destination address or fragment id parsed), loaded on the limiter's own pinned maps (same
/// rules, same buckets; its per-CPU caches are its own). `cargo xtask bench` builds it and
/// passes its path in `RATELIMIT_BENCH_WITHOUT_CUT`.
pub struct WithoutCut {
    ebpf: aya::Ebpf,
}

/// Where `cargo xtask bench` says the object of [`WithoutCut`] is.
pub const WITHOUT_CUT_ENV: &str = "RATELIMIT_BENCH_WITHOUT_CUT";

impl WithoutCut {
    /// Loads the object at `path` on `limiter`'s maps (a bucket store of `max_buckets`).
    pub fn load(path: &std::path::Path, limiter: &Limiter, max_buckets: u32) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        // The ELF parser wants the object 8-aligned (what `include_bytes_aligned!` gives the
        // agent's copy).
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `words` owns at least `bytes.len()` initialised bytes; u8 has no alignment.
        let aligned =
            unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), bytes.len()) };
        aligned.copy_from_slice(&bytes);
        let mut ebpf = aya::EbpfLoader::new()
            .default_map_pin_directory(limiter.tdp.pin_dir())
            .map_max_entries(
                map_names::BUCKETS,
                ratelimit_common::bucket_capacity(max_buckets),
            )
            .load(aligned)
            .with_context(|| format!("loading {}", path.display()))?;
        let prog: &mut Xdp = ebpf
            .program_mut(ratelimit_common::PROGRAM_NAME)
            .context("no XDP program in the bench-only object")?
            .try_into()
            .context("not an XDP program")?;
        prog.load()
            .with_context(|| format!("verifying the program of {}", path.display()))?;
        Ok(Self { ebpf })
    }

    fn program(&self) -> &Xdp {
        self.ebpf
            .program(ratelimit_common::PROGRAM_NAME)
            .expect("loaded")
            .try_into()
            .expect("an XDP program")
    }
}

/// The whole-packet cost of the handling of cut packets (issue #11: at most 2 ns on the admitted
/// figure): the limiter and [`WithoutCut`] on the same whole frames, alternately within each run
/// (floor, then each case with and without), in one run of the bench. Each `.diff` figure's runs
/// are the paired differences (with - without) of one run. Skipped, saying so, when
/// [`WITHOUT_CUT_ENV`] is not set (the runner started by hand).
pub fn cut_ab(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
    max_buckets: u32,
) -> Result<()> {
    let Some(path) = std::env::var_os(WITHOUT_CUT_ENV) else {
        eprintln!(
            "==> bench: {WITHOUT_CUT_ENV} not set (cargo xtask bench sets it): no A/B of the \
             handling of cut packets"
        );
        return Ok(());
    };
    crate::session::announce(
        "in-kernel cost: whole packets with and without the handling of cut packets",
    );
    // The variant is another build of the program: the compiler lays it out on its own, and it
    // can fail the verifier where the agent's program passes (at e220dd3: "combined stack size of
    // 3 calls is 544"). The A/B is then not measured, said, and the rest of the bench runs.
    let without = match WithoutCut::load(std::path::Path::new(&path), limiter, max_buckets) {
        Ok(w) => w,
        Err(e) => {
            eprintln!(
                "==> bench: no A/B of the handling of cut packets: the variant without it does \
                 not load: {}",
                format!("{e:#}").lines().next().unwrap_or_default()
            );
            return Ok(());
        }
    };
    let cases: [(&str, &str, Vec<u8>); 4] = [
        (
            "admitted",
            "known source, admitted",
            v4_frame([198, 18, 0, 1]),
        ),
        (
            "ipv6",
            "IPv6 known source, admitted",
            eth()
                .ipv6(
                    "2001:db8::1".parse().expect("address"),
                    "2001:db8::2".parse().expect("address"),
                )
                .udp(40_000, 9)
                .pad_to(78)
                .build(),
        ),
        ("allow_rule", "allow rule", v4_frame([198, 18, 3, 1])),
        ("no_match", "no rule matches", v4_frame([198, 19, 0, 1])),
    ];
    let floor_frame = v4_frame([198, 18, 0, 1]);
    for (_, _, frame) in &cases {
        repeat_ns(limiter.program(), frame, 1000)?;
        repeat_ns(without.program(), frame, 1000)?;
    }
    let mut floor = Vec::new();
    let mut with = vec![Vec::new(); cases.len()];
    let mut wo = vec![Vec::new(); cases.len()];
    let mut actions = vec![(0, 0); cases.len()];
    for run in 0..opts.runs {
        crate::session::check_interrupted()?;
        floor.push(repeat_ns(refs.program(PASS), &floor_frame, opts.repeat)?.0 + TRUNCATION);
        for (i, (_, _, frame)) in cases.iter().enumerate() {
            // Which goes first alternates from run to run.
            let order = if run % 2 == 0 {
                [true, false]
            } else {
                [false, true]
            };
            for real in order {
                let prog = if real {
                    limiter.program()
                } else {
                    without.program()
                };
                let (k, _, action) = repeat_ns(prog, frame, opts.repeat)?;
                if real {
                    with[i].push(k + TRUNCATION);
                    actions[i].0 = action;
                } else {
                    wo[i].push(k + TRUNCATION);
                    actions[i].1 = action;
                }
            }
        }
    }
    const FLOOR: &str = "kernel.cut_ab.floor";
    report.add(Figure {
        key: FLOOR.into(),
        section: SECTION_CUT,
        label: "floor: XDP_PASS, re-measured next to the A/B".into(),
        unit: "ns/pkt",
        runs: floor,
        baseline: None,
        detail: json!({ "repeat": opts.repeat }),
    });
    for (i, (name, what, _)) in cases.iter().enumerate() {
        let (k_with, k_without, k_diff) = cut_ab_keys(name);
        let diff: Vec<f64> = with[i].iter().zip(&wo[i]).map(|(a, b)| a - b).collect();
        report.add(Figure {
            key: k_without.clone(),
            section: SECTION_CUT,
            label: format!("without the handling of cut packets: {what}"),
            unit: "ns/pkt",
            runs: wo[i].clone(),
            baseline: Some(FLOOR.into()),
            detail: json!({ "repeat": opts.repeat, "object": path.to_string_lossy(), "xdp_action": action_name(actions[i].1) }),
        });
        report.add(Figure {
            key: k_with.clone(),
            section: SECTION_CUT,
            label: format!("with it (the agent's program): {what}"),
            unit: "ns/pkt",
            runs: with[i].clone(),
            baseline: Some(k_without),
            detail: json!({ "repeat": opts.repeat, "xdp_action": action_name(actions[i].0) }),
        });
        report.add(Figure {
            key: k_diff,
            section: SECTION_CUT,
            label: format!("difference, with - without, paired by run: {what}"),
            unit: "ns/pkt",
            runs: diff,
            baseline: None,
            detail: json!({}),
        });
    }
    Ok(())
}

/// The keys of one [`cut_ab`] case: with, without, the paired difference.
pub fn cut_ab_keys(name: &str) -> (String, String, String) {
    (
        format!("kernel.cut_ab.{name}.with"),
        format!("kernel.cut_ab.{name}.without"),
        format!("kernel.cut_ab.{name}.diff"),
    )
}

const SECTION_CUT: &str =
    "Whole packets with and without the handling of cut packets, alternately (BPF_PROG_TEST_RUN)";
