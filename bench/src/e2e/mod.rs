//! End to end: frames from a live-frames generator in one namespace cross a veth pair into
//! another, whose veth runs the contender; packets per second handled by the receiving side.
//!
//! The generator ([`crate::generator`]) and the receiving veth's NAPI poll share one CPU: the
//! test run hands each batch to the peer and re-enables bottom halves, which runs the receiver
//! right there. So the rate is that of the whole pipeline on one core, generator included, the
//! same for every contender; a contender that costs more per packet lowers it. Handled = the
//! receiving veth's `rx_packets` delta, which counts every frame its XDP hook saw (frames lost
//! because its ring was full show up as `rx_dropped` instead and are reported apart).
//!
//! Frames go to 198.18.1.1, an address nobody has, with forwarding off: whatever a contender lets
//! through costs the receiving stack one route lookup and a quiet drop, the same for all.
//!
//! This file holds the settings every contender shares (the rules, rates, addresses), the
//! traffic patterns and the run over every contender; `testbed.rs` the namespaces and the veth
//! pair, `contenders.rs` what receives the flood (attached, counted, detached), `measure.rs` one
//! contender's runs, or a group's in turns.

mod contenders;
mod measure;
mod testbed;

use std::{net::Ipv4Addr, time::Duration};

use anyhow::{bail, Result};
use ratelimit_common::DEFAULT_MAX_BUCKETS;
use serde_json::Value;

pub use self::testbed::Testbed;
use self::{
    contenders::{Contender, ALL},
    measure::{measure_group, LAYERED_GROUP},
};
use crate::{
    kernel::Limiter,
    refs::Refs,
    report::{Figure, Report},
    session::Options,
};

/// The limiter's rule and the contenders' equivalents: 1000 packets/s per source, bursts of 2000.
pub const RATE: u64 = 1000;
/// See [`RATE`].
pub const BURST: u64 = 2000;
/// Sources each contender can track: the limiter's default bucket store capacity.
pub const TRACKED: u32 = DEFAULT_MAX_BUCKETS;

const E2E_RULES: &str = r#"
[[rule]]
name = "per-source"
source = "0.0.0.0/0"
rate = 1000
burst = 2000
per = "source"
"#;

/// The layered policy of the aggregate case: per source as [`E2E_RULES`], and the whole rule
/// together [`AGGREGATE_RATE`] (a `[[rule.limit]] per = "rule"`), so that a random-source flood,
/// which every per-source limit lets through (each source is new, with a full bucket), is dropped
/// by the aggregate in XDP. The test bed's own /24 (the polite and the fresh flooding sources)
/// has a per-source rule of its own, outside the aggregate, as nftables' policy exempts it.
const LAYERED_RULES: &str = r#"
[[rule]]
name = "layered"
source = "0.0.0.0/0"
rate = 1000
burst = 2000
per = "source"

[[rule.limit]]
per = "rule"
rate = 10000
burst = 1000

[[rule]]
name = "known"
source = "198.18.0.0/24"
rate = 1000
burst = 2000
per = "source"
"#;
/// [`LAYERED_RULES`] with the two limits the other way round: the per-rule limit is the rule's
/// own (charged first), the per-source one its `[[rule.limit]]`. A packet passes under the same
/// condition (a token in every limit; a dropped packet spends none), but the flood's excess is
/// dropped by the shared bucket before a bucket is made for its new source.
const LAYERED_FIRST_RULES: &str = r#"
[[rule]]
name = "layered"
source = "0.0.0.0/0"
rate = 10000
burst = 1000
per = "rule"

[[rule.limit]]
per = "source"
rate = 1000
burst = 2000

[[rule]]
name = "known"
source = "198.18.0.0/24"
rate = 1000
burst = 2000
per = "source"
"#;
/// The aggregate limit of [`LAYERED_RULES`], packets per second and burst: under 1% of the
/// flood, so that what it admits (which goes on to the stack, several times a drop's cost) weighs
/// little beside the drop-all floor, which admits nothing (at 100,000/s, 6% of the flood, each
/// admitted packet also made a new source's bucket and crossed the stack).
pub const AGGREGATE_RATE: u64 = 10_000;
/// See [`AGGREGATE_RATE`].
pub const AGGREGATE_BURST: u64 = 1_000;
/// The test bed's own prefix (the polite and fresh flooding sources), outside the aggregate.
const KNOWN_NET: &str = "198.18.0.0/24";

/// A fresh source that floods over its limit during the last run of a flood: a contender that
/// still limits new sources passes about `BURST + RATE * span` of its packets.
const ABUSER: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 3);
const ABUSER_PPS: u64 = 50_000;
const ABUSER_SPAN: Duration = Duration::from_millis(100);

/// Longest warm-up of a random flood (it stops earlier once the tables must be full).
const WARMUP_LIMIT: Duration = Duration::from_secs(8);
/// Longest warm-up of the known sources: the slowest contender (nftables, ~0.3 Mpps on a busy
/// machine) needs 12 s for its 7 frames a source; cut short, its runs would still insert the
/// sources it had not seen, a cost the others no longer pay.
const KNOWN_WARMUP_LIMIT: Duration = Duration::from_secs(20);

/// The polite source: well under the limit, sent through the ordinary stack while the flood runs.
pub const POLITE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
pub const POLITE_PPS: u64 = 200;
pub const SERVER: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 254);
const HOT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The limiter's table is filled from here on (away from the random flood's 10.0.0.0/8).
const PREFILL_FROM: [u8; 4] = [11, 0, 0, 0];
/// Where the flood goes: an address of the receiving subnet that no interface has.
const SINK: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 1);

/// Traffic pattern.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pattern {
    /// One source, always the same frame.
    Hot,
    /// A random source (24 random bits) per frame.
    Random,
    /// A random one of 2^19 sources per frame ([`crate::generator::KNOWN_BITS`]): every table
    /// half full once warm, each source sending again and again, none new.
    Known,
}

impl Pattern {
    fn tag(self) -> &'static str {
        match self {
            Pattern::Hot => "hot",
            Pattern::Random => "random",
            Pattern::Known => "known",
        }
    }
}

const SECTION_SEMANTICS: &str = "During the random flood, tables full: a polite source (200 pps) \
     and a fresh source flooding at 50,000 pps for 0.1 s (its limit lets ~2100 through)";

/// What the polite and the fresh flooding source saw under `contender`, from a random-flood
/// figure's details: two figures of one run each (the fresh source floods in the last run only).
fn flood_semantics(figure: &Figure, contender: Contender) -> (Figure, Figure) {
    let polite = &figure.detail["polite"];
    let abuser = &figure.detail["fresh_abuser"];
    let share = |d: &Value| {
        let (sent, received) = (
            d["sent"].as_f64().unwrap_or(0.0),
            d["received"].as_f64().unwrap_or(0.0),
        );
        if sent > 0.0 {
            received / sent * 100.0
        } else {
            f64::NAN
        }
    };
    let tag = contender.tag();
    let name = tag.replace('_', " ");
    (
        Figure {
            key: format!("e2e.random.{tag}.polite_received"),
            section: SECTION_SEMANTICS,
            label: format!("{name}: polite source's packets received"),
            unit: "%",
            runs: vec![share(polite)],
            baseline: None,
            detail: polite.clone(),
        },
        Figure {
            key: format!("e2e.random.{tag}.fresh_flooder_passed"),
            section: SECTION_SEMANTICS,
            label: format!("{name}: fresh flooding source's packets passed"),
            unit: "%",
            runs: vec![share(abuser)],
            baseline: None,
            detail: abuser.clone(),
        },
    )
}

/// Runs every contender (or those `--contenders` names) under both patterns.
pub fn run(report: &mut Report, opts: &Options, refs: &mut Refs) -> Result<()> {
    for t in &opts.contenders {
        if !ALL.iter().any(|c| c.tag() == t) {
            let known: Vec<&str> = ALL.iter().map(|c| c.tag()).collect();
            bail!(
                "--contenders: no contender {t:?} (the contenders: {})",
                known.join(", ")
            );
        }
    }
    const PATTERNS: [Pattern; 3] = [Pattern::Hot, Pattern::Random, Pattern::Known];
    for t in &opts.patterns {
        if !PATTERNS.iter().any(|p| p.tag() == t) {
            bail!("--patterns: no pattern {t:?} (the patterns: hot, random, known)");
        }
    }
    let bed = Testbed::new()?;
    let mut limiter = Limiter::new("e2e", TRACKED, E2E_RULES)?;
    let mut semantics = Vec::new();
    for pattern in PATTERNS {
        if !opts.patterns.is_empty() && !opts.patterns.iter().any(|t| t == pattern.tag()) {
            continue;
        }
        if pattern == Pattern::Known {
            // An empty store, as the other contenders' tables start: the random flood left this
            // one full, and the known sources would each evict a stale bucket.
            limiter = Limiter::new("e2e-known", TRACKED, E2E_RULES)?;
            refs.unload_lrus();
        }
        // Each group's contenders are measured in turns, one run each (see `measure_group`).
        let mut groups: Vec<Vec<Contender>> = match pattern {
            // The hot target (the limiter at >= 95% of drop-all) is a ratio of a few percent
            // too: 94.6% and 99.2% in two runs minutes apart, measured one after the other.
            // The LRU contender beside them: what a user would pick instead, whose drop reads
            // the packet and one map entry, as the limiter's does; and the floor that reads
            // the frame, which drop-all never does.
            Pattern::Hot => vec![vec![
                Contender::DropAll,
                Contender::Limiter,
                Contender::Lru,
                Contender::ReadDrop,
            ]],
            // The limiter's targets against the LRU contender (>= 1.25x) and XDP_PASS (>= 80%)
            // are ratios: in turns. Measured after the others instead, XDP_PASS read 0.98 to
            // 1.17 Mpps between runs of one afternoon, and the limiter's share of it 76% to 86%.
            Pattern::Random | Pattern::Known => vec![
                vec![Contender::DropAll],
                vec![
                    Contender::Limiter,
                    Contender::Lru,
                    Contender::LruPerCpu,
                    Contender::Pass,
                ],
            ],
        };
        if pattern == Pattern::Known {
            // Tables that hold every source: nftables' set (2^20) limits each of them, as the
            // others do; its overflow under the random flood says nothing here.
            groups.push(vec![Contender::Nft]);
        } else {
            groups.extend([Contender::Nft, Contender::Iptables].map(|c| vec![c]));
        }
        if pattern == Pattern::Random {
            groups.push(LAYERED_GROUP.to_vec());
            groups.extend([
                vec![Contender::NftAggregate],
                vec![Contender::NftAggregateFirst],
            ]);
        }
        for mut group in groups {
            if !opts.contenders.is_empty() {
                group.retain(|c| opts.contenders.iter().any(|t| t == c.tag()));
                if group.is_empty() {
                    continue;
                }
            }
            let labels: Vec<&str> = group.iter().map(|c| c.label()).collect();
            crate::session::announce(&format!(
                "end to end, {} source{}: {}",
                pattern.tag(),
                if pattern == Pattern::Hot { "" } else { "s" },
                labels.join("; in turns with: ")
            ));
            for (contender, figure) in
                measure_group(opts, refs, &bed, &mut limiter, pattern, &group)?
            {
                if pattern == Pattern::Random && !contender.floor() {
                    semantics.push(flood_semantics(&figure, contender));
                }
                report.add(figure);
            }
        }
    }
    for (polite, abuser) in semantics {
        report.add(polite);
        report.add(abuser);
    }
    Ok(())
}
