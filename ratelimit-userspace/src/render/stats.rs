//! `ratelimit stats`: the counters report rebuilt from its JSON and printed as the offline
//! report prints it, so both read alike.

use std::collections::BTreeMap;

use ratelimit_common::{global, verdict};
use serde_json::Value;

use super::{num, text};
use crate::stats::{BucketReport, RuleReport, StatsReport};

/// `ratelimit stats`: the report from its JSON, as [`StatsReport::to_table`] prints it.
/// Counters this build does not know (a newer agent) are left out.
#[must_use]
pub fn stats(v: &Value) -> String {
    let known = |names: &[&'static str], m: &Value| -> BTreeMap<&'static str, u64> {
        names
            .iter()
            .filter(|n| !n.is_empty())
            .filter_map(|n| m.get(*n).and_then(Value::as_u64).map(|c| (*n, c)))
            .collect()
    };
    let empty = Vec::new();
    let report = StatsReport {
        global: known(&global::NAMES, &v["global"]),
        rules: v["rules"]
            .as_array()
            .unwrap_or(&empty)
            .iter()
            .map(|r| RuleReport {
                id: u32::try_from(num(r, "id")).unwrap_or(0),
                name: text(r, "name").to_string(),
                line: u32::try_from(num(r, "line")).unwrap_or(0),
                packets: known(&verdict::NAMES, &r["packets"]),
                bytes: known(&verdict::NAMES, &r["bytes"]),
                limits: r["limits"]
                    .as_array()
                    .unwrap_or(&empty)
                    .iter()
                    .map(|l| crate::stats::LimitReport {
                        limit: usize::try_from(num(l, "limit")).unwrap_or(0),
                        per: text(l, "per").to_string(),
                        dropped_rate: num(l, "dropped_rate"),
                        dropped_bytes: num(l, "dropped_bytes"),
                    })
                    .collect(),
            })
            .collect(),
        buckets: BucketReport {
            tracked: num(&v["buckets"], "tracked"),
            capacity: num(&v["buckets"], "capacity"),
        },
    };
    report.to_table()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_table_matches_the_offline_one() {
        let mut report = StatsReport::default();
        report.global.insert("packets", 10);
        report.rules.push(RuleReport {
            id: 1,
            name: "r".into(),
            line: 3,
            packets: verdict::NAMES.iter().map(|n| (*n, 2)).collect(),
            bytes: verdict::NAMES.iter().map(|n| (*n, 200)).collect(),
            limits: (1..=2)
                .map(|limit| crate::stats::LimitReport {
                    limit,
                    per: if limit == 1 { "source" } else { "/24" }.into(),
                    dropped_rate: 1,
                    dropped_bytes: 0,
                })
                .collect(),
        });
        report.buckets = BucketReport {
            tracked: 1,
            capacity: 16,
        };
        assert_eq!(
            stats(&serde_json::to_value(&report).unwrap()),
            report.to_table()
        );
    }
}
