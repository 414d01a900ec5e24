//! Rule update latency with 10,000 rules: how long `Dataplane::install` takes to put a rule set
//! in force (records, the inactive half of the prefix trie, the switch, the grace period, the old
//! half cleared). Buckets of rules that left are not walked: their rule's generation is retired
//! and the program recycles their records.

use anyhow::Result;
use ratelimit::config::{Config, RuleConfig};
use ratelimit_common::map_names;
use serde_json::json;

use crate::{
    kernel::{map_memory, Limiter, BASE_RULES},
    report::{Figure, Report},
    session::Options,
};

const SECTION: &str = "Memory and control plane";
/// Rules in the large set.
pub const MANY: usize = 10_000;

/// The base rules plus [`MANY`] per-source limits on prefixes of their own (11.x.y.0/24, which no
/// bench frame uses). `rate` of rule 0 is `rate0`, so a new value is a changed rule.
pub fn many_rules(rate0: u64) -> Result<Vec<RuleConfig>> {
    let mut rules = Config::parse(BASE_RULES, "bench.toml")?.rules;
    for i in 0..MANY {
        let net = format!("11.{}.{}.0/24", i >> 8, i & 0xff).parse()?;
        let mut r = RuleConfig::new(format!("r{i}"), net);
        r.rate = Some(if i == 0 { rate0 } else { 1000 });
        r.burst = Some(2000);
        rules.push(r);
    }
    Ok(rules)
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Installs the 10,000-rule set over the base set and back, then changes one rule of the large
/// set, `opts.runs` times each (at least 3). `tag`/`what` say what the bucket store holds.
pub fn latency(
    report: &mut Report,
    opts: &Options,
    limiter: &mut Limiter,
    tag: &str,
    what: &str,
) -> Result<()> {
    crate::session::announce(&format!("rule update latency, 10,000 rules ({what})"));
    let base = Config::parse(BASE_RULES, "bench.toml")?.rules;
    let runs = opts.runs.max(3);
    let (mut add, mut add_compile, mut remove, mut change, mut change_compile) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut prefix_memory = 0;
    for run in 0..runs {
        crate::session::check_interrupted()?;
        let (c, i) = limiter.install(&many_rules(1000)?)?;
        add_compile.push(ms(c));
        add.push(ms(i));
        if run == 0 {
            prefix_memory = map_memory(limiter, map_names::PREFIXES)?.0;
        }
        let (c, i) = limiter.install(&many_rules(1001)?)?;
        change_compile.push(ms(c));
        change.push(ms(i));
        let (_, i) = limiter.install(&base)?;
        remove.push(ms(i));
    }
    let buckets = limiter.tdp.global().counters[ratelimit_common::global::NEW_BUCKETS];
    let detail = json!({
        "rules": MANY + base.len(),
        "buckets_created_so_far": buckets,
        "buckets_tracked_after": limiter.tdp.maps().bucket_count()?,
        "includes_grace_ms": 20,
    });
    report.add(Figure {
        key: format!("control.{tag}.install_10k"),
        section: SECTION,
        label: format!("install 10,000 new rules ({what})"),
        unit: "ms",
        runs: add,
        baseline: None,
        detail: json!({ "compile_ms": add_compile, "common": detail }),
    });
    report.add(Figure {
        key: format!("control.{tag}.change_1_of_10k"),
        section: SECTION,
        label: format!("change 1 rule of 10,000 ({what})"),
        unit: "ms",
        runs: change,
        baseline: None,
        detail: json!({ "compile_ms": change_compile, "common": detail }),
    });
    report.add(Figure {
        key: format!("control.{tag}.remove_10k"),
        section: SECTION,
        label: format!("remove 10,000 rules ({what})"),
        unit: "ms",
        runs: remove,
        baseline: None,
        detail,
    });
    if tag == "empty" {
        #[expect(clippy::cast_precision_loss, reason = "bytes")]
        let per = prefix_memory as f64 / (MANY + base.len()) as f64;
        report.add(Figure {
            key: "memory.kernel_per_rule_prefix".into(),
            section: SECTION,
            label: "kernel memory per rule prefix (prefix trie, 10,006 prefixes)".into(),
            unit: "bytes",
            runs: vec![per],
            baseline: None,
            detail: json!({ "memlock_bytes": prefix_memory }),
        });
    }
    Ok(())
}
