//! In-kernel cost per packet, through BPF_PROG_TEST_RUN: the floor (an XDP_PASS program) and the
//! limiter on the same frames, interleaved run by run so that both see the same machine.
//!
//! Every figure is one BPF_PROG_TEST_RUN call with `repeat` (1,000,000 unless said otherwise);
//! the kernel reports the mean time per run, in whole nanoseconds (truncated, so half a nanosecond
//! is added back). A hot source runs one frame again and again. New sources and random known
//! sources run behind a *driver* ([`progs::driver`]) that rewrites the source address of the
//! (shared) frame buffer on every run and tail-calls the limiter; the same driver tail-calling
//! `bench_pass` is the floor those are compared with.
//!
//! This file holds what the cases share: the limiter under test ([`Limiter`], its rules
//! [`BASE_RULES`]), one timed call ([`repeat_ns`]), the frames, and the [`Driver`]. The cases,
//! one file each:
//! - `hot.rs`: hot frames (known sources, fragments, IPv6, TCP flags, rules with 1-3 limits,
//!   10,000 more rules) against the floor;
//! - `layered.rs`: a random-source flood under an exhausted per-rule limit;
//! - `populations.rs`: 1k to 1M tracked sources and a full store (hot, random known and new
//!   sources, the memory floors), and the census that keeps each population what it says;
//! - `lru.rs`: the LRU contender (`crate::lru`) at the same populations, in turns with them;
//! - `probes.rs`: programs doing one operation of the fast path each;
//! - `memory.rs`: the bucket store's kernel memory;
//! - `cpus.rs`: one hot source charged from every CPU at once;
//! - `cut.rs`: the A/B of the handling of cut packets on whole packets.

mod cpus;
mod cut;
mod hot;
mod layered;
mod lru;
mod memory;
mod populations;
mod probes;

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use aya::{
    maps::MapData,
    programs::{TestRun as _, TestRunOptions, Xdp},
};
use ratelimit::{
    compile::{compile, CompiledRuleSet, RuleIds},
    config::{Config, RuleConfig},
};
use ratelimit_common::global;
use ratelimit_testbed::{packet::eth, TestDataplane};

pub use self::{
    cpus::cpus,
    cut::{cut_ab, cut_ab_keys},
    hot::{hot, hot_limits, hot_tcp_flags, hot_with_rules, LIMIT_RULES, TCP_RULES},
    layered::layered_flood,
    memory::{map_memory, memory},
    populations::{populations, IN_CACHE_BUCKETS},
    probes::probes,
};
use crate::{
    progs::{self, Sources, Touch},
    refs::Refs,
};

const SECTION: &str = "In-kernel cost per packet (BPF_PROG_TEST_RUN)";

/// The table section of [`populations`] and the LRU contender beside it.
const SECTION_POP: &str = "In-kernel cost per packet vs tracked sources (BPF_PROG_TEST_RUN)";

/// The limiter's rules for the in-kernel runs: one per case, on prefixes of their own.
/// `rate = 1e9` never runs dry in a test run (at most a few tens of millions of runs a second);
/// a tolerance of 1 s selects the coarse clock (see `rule_record`), 1 ms the precise one, 10 s
/// the coarse clock alone (`COARSE_ONLY`: at least 100 times its lag allowance at any HZ).
/// `drop` opens 1 s drop windows, far from their end; `drop-1k` the 1 ms windows of the end to
/// end hot source's limit (held on the coarse clock, `HOLD_WINDOW`), and `drop-1k-per24` the
/// same on a shared bucket, decided on the precise clock near their end.
pub const BASE_RULES: &str = r#"
[[rule]]
name = "admit"
source = "198.18.0.0/24"
rate = 1000000000
burst = 1000000000

[[rule]]
name = "admit-coarse-only"
source = "198.18.16.0/24"
rate = 1000000000
burst = 10000000000

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
name = "drop-1k"
source = "198.18.17.0/24"
rate = 1000
burst = 2000

[[rule]]
name = "drop-1k-per24"
source = "198.18.18.0/24"
per = "/24"
rate = 1000
burst = 2000

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

    /// Runs `f` with every installed limit making its keys' buckets at their first packet
    /// (`rule_flags::FIRST_FREE` cleared in the rule records, put back after): the bench grows
    /// its populations with one packet per source, which would otherwise pass without a bucket.
    pub fn making_buckets<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let mut maps = ratelimit::maps::PinnedMaps::open(self.tdp.pin_dir())?;
        let saved = self
            .set
            .rules
            .iter()
            .map(|r| Ok((r.id, maps.rule(r.id)?)))
            .collect::<Result<Vec<_>>>()?;
        for &(id, _) in &saved {
            ratelimit_testbed::xdp::making_buckets(&mut maps, id)?;
        }
        let out = f();
        for &(id, rule) in &saved {
            maps.set_rule(id, rule)?;
        }
        out
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

/// A frame of the bench's IPv6 known source (2001:db8::1, UDP to port 9 of 2001:db8::2).
pub(crate) fn v6_frame() -> Vec<u8> {
    eth()
        .ipv6(
            "2001:db8::1".parse().expect("address"),
            "2001:db8::2".parse().expect("address"),
        )
        .udp(40_000, 9)
        .pad_to(78)
        .build()
}

/// The kernel reports whole nanoseconds, truncated: half a nanosecond is added back so that a
/// floor of "7" (7.0 to 7.99) is not taken for less than it is.
pub(crate) const TRUNCATION: f64 = 0.5;

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

/// Runs `n` sources from `first` on through the limiter, one packet each, each making its bucket
/// ([`Limiter::making_buckets`]); returns how many buckets that created.
pub fn fill(limiter: &Limiter, refs: &Refs, first: [u8; 4], n: u32) -> Result<u64> {
    let before = limiter.tdp.global().counters[global::NEW_BUCKETS];
    let driver = Driver::new("rlb_fill", Sources::Sequential, limiter.program(), refs)?;
    limiter.making_buckets(|| {
        let mut left = n;
        let mut from = first;
        while left > 0 {
            crate::session::check_interrupted()?;
            let chunk = left.min(1 << 20);
            driver.run(&sequential_from(from), chunk)?;
            from = (u32::from_be_bytes(from) + chunk).to_be_bytes();
            left -= chunk;
        }
        Ok(())
    })?;
    Ok(limiter.tdp.global().counters[global::NEW_BUCKETS] - before)
}

/// A frame whose source is `first - 1`, for a [`Sources::Sequential`] driver to start at `first`.
pub(crate) fn sequential_from(first: [u8; 4]) -> Vec<u8> {
    v4_frame((u32::from_be_bytes(first).wrapping_sub(1)).to_be_bytes())
}

fn pinned(limiter: &Limiter, name: &str) -> Result<MapData> {
    let path = limiter.tdp.pin_dir().join(name);
    MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))
}
