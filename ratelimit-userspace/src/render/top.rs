//! `ratelimit top`: the busiest buckets over an interval, one row each.

use std::fmt::Write as _;

use serde_json::Value;

use super::{cell, num, rate, table};

/// `ratelimit top`.
#[must_use]
pub fn top(v: &Value) -> String {
    let empty = Vec::new();
    let entries = v["top"].as_array().unwrap_or(&empty);
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            // A bucket of a rule's second or later limit: "web limit 2".
            let rule = match e["limit"].as_u64() {
                Some(l) if l > 1 => format!("{} limit {l}", cell(&e["rule"])),
                _ => cell(&e["rule"]),
            };
            vec![
                rule,
                cell(&e["source"]),
                rate(&e["pps"]),
                rate(&e["drops_per_sec"]),
                rate(&e["tokens"]),
                cell(&e["passed"]),
                cell(&e["dropped"]),
            ]
        })
        .collect();
    let mut out = if rows.is_empty() {
        String::new()
    } else {
        table(
            &[
                "RULE", "SOURCE", "PPS", "DROPS/S", "TOKENS", "PASSED", "DROPPED",
            ],
            &rows,
        )
    };
    let _ = write!(
        out,
        "{} of {} tracked buckets saw packets in the last {} ms",
        num(v, "active"),
        num(v, "buckets_tracked"),
        num(v, "interval_ms")
    );
    let windows = v["windows"].as_u64().unwrap_or(1);
    if windows > 1 {
        let _ = write!(out, " (measured in {windows} successive windows)");
    }
    let _ = writeln!(out);
    out
}
