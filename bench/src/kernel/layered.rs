//! A random-source flood under a rule whose per-rule limit is exhausted (#16's layered policy):
//! every packet from a new source, dropped by the per-rule limit, against the same driver
//! tail-calling XDP_PASS.

use anyhow::Result;
use ratelimit_common::{global, verdict};
use serde_json::json;

use super::{sequential_from, Driver, Limiter, IN_CACHE_BUCKETS, SECTION};
use crate::{
    progs::Sources,
    refs::{Refs, PASS},
    report::{Figure, Report},
    session::Options,
};

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
