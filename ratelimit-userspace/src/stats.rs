//! Counter reports: what `ratelimit stats` prints and `--json` emits.
//!
//! The JSON shape is part of the user-facing contract (documented in docs/operations.md, "Counters"):
//! `{"global": {"packets": N, "non_ip": N, ...}, "rules": [{"id", "name", "line", "packets":
//! {"passed", "allowed", "dropped_rate", "dropped_bytes", "denied", "dry_run", "no_bucket"},
//! "bytes": {...}, "limits": [{"limit": 1, "per": "source", "dropped_rate": N, "dropped_bytes": N},
//! ...]}], "buckets": {"tracked": N, "capacity": N}}`. `limits` (limit rules only) says which of
//! the rule's limits dropped what: 1 is the rule's own, 2.. its `[[rule.limit]]`s in order; their
//! sums are the rule's `dropped_rate` and `dropped_bytes` (under dry run, its would-be drops).

use std::{collections::BTreeMap, fmt::Write as _};

use ratelimit_common::{action, global, verdict};
use serde::Serialize;

use crate::maps::{MapsError, PinnedMaps};

/// Counters of one rule.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct RuleReport {
    /// Rule id.
    pub id: u32,
    /// Rule name.
    pub name: String,
    /// Config line of the rule (0 if unknown).
    pub line: u32,
    /// Packets by verdict name.
    pub packets: BTreeMap<&'static str, u64>,
    /// Bytes by verdict name.
    pub bytes: BTreeMap<&'static str, u64>,
    /// Drops by each of the rule's limits (limit rules only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub limits: Vec<LimitReport>,
}

/// Drops of one limit of a rule.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct LimitReport {
    /// 1: the rule's own limit; 2..: its `[[rule.limit]]`s in order.
    pub limit: usize,
    /// The limit's `per` as written (`source`, `/24`, `rule`).
    pub per: String,
    /// Packets this limit dropped for their packet rate.
    pub dropped_rate: u64,
    /// Packets this limit dropped for their byte rate.
    pub dropped_bytes: u64,
}

/// The `per` a limit's source mask stands for.
pub(crate) fn per_of(mask: &[u32; 4]) -> String {
    let bits: u32 = mask.iter().map(|w| w.count_ones()).sum();
    match bits {
        0 => "rule".to_owned(),
        32 if mask[1..] == [0; 3] => "source".to_owned(),
        128 => "source".to_owned(),
        n => format!("/{n}"),
    }
}

/// Bucket map occupancy.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct BucketReport {
    /// Buckets (sources) currently tracked.
    pub tracked: u64,
    /// Capacity of the bucket map.
    pub capacity: u64,
}

/// Everything `stats` shows.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct StatsReport {
    /// Program-wide counters by name.
    pub global: BTreeMap<&'static str, u64>,
    /// Per-rule counters, by rule id.
    pub rules: Vec<RuleReport>,
    /// Bucket map occupancy.
    pub buckets: BucketReport,
}

impl StatsReport {
    /// Reads the counters from the pinned maps, and counts the buckets by walking the store: for
    /// `stats --pin-path`, which has no agent to ask. The agent reports its census instead
    /// ([`StatsReport::read_counters`]).
    pub fn read(maps: &PinnedMaps) -> Result<Self, MapsError> {
        let rules = maps
            .named_rules()?
            .into_iter()
            .map(|(id, (name, line, _))| (id, name, line));
        Self::read_counters(maps, rules, maps.bucket_count()?)
    }

    /// Reads the program's counters and those of `rules` (id, name, config line), with `tracked`
    /// buckets: a few system calls per rule, no walk of the bucket store.
    pub fn read_counters(
        maps: &PinnedMaps,
        rules: impl IntoIterator<Item = (u32, String, u32)>,
        tracked: u64,
    ) -> Result<Self, MapsError> {
        let g = maps.global_stats()?;
        let global = global::NAMES
            .iter()
            .zip(g.counters)
            .filter(|(name, _)| !name.is_empty())
            .map(|(name, v)| (*name, v))
            .collect();
        let mut rules: Vec<_> = rules.into_iter().collect();
        rules.sort_by_key(|r| r.0);
        let mut reports = Vec::with_capacity(rules.len());
        for (id, name, line) in rules {
            let s = maps.rule_stats(id)?;
            let rule = maps.rule(id)?;
            let limits = if rule.action == action::LIMIT {
                (0..rule.limits())
                    .map(|k| LimitReport {
                        limit: k + 1,
                        per: per_of(&rule.limit(k).unwrap_or_default().src_mask),
                        dropped_rate: s.limit_dropped_rate[k],
                        dropped_bytes: s.limit_dropped_bytes[k],
                    })
                    .collect()
            } else {
                Vec::new()
            };
            reports.push(RuleReport {
                id,
                name,
                line,
                packets: verdict::NAMES.iter().copied().zip(s.pkts).collect(),
                bytes: verdict::NAMES.iter().copied().zip(s.bytes).collect(),
                limits,
            });
        }
        let buckets = BucketReport {
            tracked,
            capacity: u64::from(maps.bucket_capacity()?),
        };
        Ok(Self {
            global,
            rules: reports,
            buckets,
        })
    }

    /// Packets of rule `name` with verdict `verdict` (0 if either is unknown).
    #[must_use]
    pub fn rule_packets(&self, name: &str, verdict: &str) -> u64 {
        self.rules
            .iter()
            .find(|r| r.name == name)
            .and_then(|r| r.packets.get(verdict).copied())
            .unwrap_or(0)
    }

    /// A human-readable table.
    #[must_use]
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let width = self
            .rules
            .iter()
            .map(|r| r.name.len())
            .max()
            .unwrap_or(4)
            .max(4);
        let _ = writeln!(
            out,
            "{:<width$}  {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
            "RULE", "PASSED", "ALLOWED", "DROP_RATE", "DROP_BYTES", "DENIED", "DRY_RUN"
        );
        for r in &self.rules {
            let p = |v: &str| r.packets.get(v).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "{:<width$}  {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
                r.name,
                p("passed"),
                p("allowed"),
                p("dropped_rate"),
                p("dropped_bytes"),
                p("denied"),
                p("dry_run"),
            );
            if r.limits.len() > 1 {
                for l in &r.limits {
                    let _ = writeln!(
                        out,
                        "{:<width$}  limit {} (per {}): dropped_rate {} dropped_bytes {}",
                        "", l.limit, l.per, l.dropped_rate, l.dropped_bytes
                    );
                }
            }
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "buckets: {} tracked of {}",
            self.buckets.tracked, self.buckets.capacity
        );
        let counters: Vec<String> = self
            .global
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let _ = writeln!(out, "global: {}", counters.join(" "));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> StatsReport {
        let counts = |v: [u64; verdict::COUNT]| verdict::NAMES.iter().copied().zip(v).collect();
        StatsReport {
            global: BTreeMap::from([("packets", 42), ("no_match", 2)]),
            rules: vec![
                RuleReport {
                    id: 0,
                    name: "default".into(),
                    line: 9,
                    packets: counts([10, 0, 30, 0, 0, 0, 1]),
                    bytes: counts([1000, 0, 3000, 0, 0, 0, 100]),
                    limits: Vec::new(),
                },
                RuleReport {
                    id: 3,
                    name: "a-much-longer-name".into(),
                    line: 20,
                    packets: counts([0, 4, 0, 5, 6, 7, 0]),
                    bytes: counts([0; verdict::COUNT]),
                    limits: Vec::new(),
                },
            ],
            buckets: BucketReport {
                tracked: 5,
                capacity: 1024,
            },
        }
    }

    #[test]
    fn a_rule_with_several_limits_says_which_dropped_what() {
        let mut r = report();
        r.rules.truncate(1);
        r.rules[0].limits = vec![
            LimitReport {
                limit: 1,
                per: "source".into(),
                dropped_rate: 10,
                dropped_bytes: 0,
            },
            LimitReport {
                limit: 2,
                per: "/24".into(),
                dropped_rate: 20,
                dropped_bytes: 0,
            },
        ];
        let table = r.to_table();
        assert!(
            table.contains("limit 2 (per /24): dropped_rate 20 dropped_bytes 0"),
            "{table}"
        );
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["rules"][0]["limits"][1]["dropped_rate"], 20);
        assert_eq!(v["rules"][0]["limits"][1]["per"], "/24");
        assert_eq!(per_of(&[u32::MAX, 0, 0, 0]), "source");
        assert_eq!(per_of(&[u32::MAX; 4]), "source");
        assert_eq!(per_of(&[0; 4]), "rule");
        assert_eq!(
            per_of(&[u32::from_ne_bytes([255, 255, 255, 0]), 0, 0, 0]),
            "/24"
        );
    }

    #[test]
    fn rule_packets_finds_the_rule_and_verdict() {
        let r = report();
        assert_eq!(r.rule_packets("default", "passed"), 10);
        assert_eq!(r.rule_packets("default", "dropped_rate"), 30);
        assert_eq!(r.rule_packets("a-much-longer-name", "dry_run"), 7);
        assert_eq!(r.rule_packets("nosuch", "passed"), 0);
        assert_eq!(r.rule_packets("default", "nosuch"), 0);
    }

    #[test]
    fn the_table_has_a_row_per_rule_the_buckets_and_the_global_counters() {
        assert_eq!(
            report().to_table(),
            "RULE                      PASSED      ALLOWED    DROP_RATE   DROP_BYTES       DENIED      DRY_RUN\n\
             default                       10            0           30            0            0            0\n\
             a-much-longer-name             0            4            0            5            6            7\n\
             \n\
             buckets: 5 tracked of 1024\n\
             global: no_match=2 packets=42\n"
        );
        // No rules: the header is four columns wide at least.
        assert!(StatsReport::default()
            .to_table()
            .starts_with("RULE        PASSED"));
    }
}
