//! `ratelimit suggest`: per rule and limit, what its sources sent (quantiles and a histogram of
//! their 10 s peak rates), the proposed `rate` and `burst`, what they would have done (and to
//! which of the heaviest sources), and the TOML to write.

use std::fmt::Write as _;

use serde_json::Value;

use super::{cell, table};

/// Width of the histogram's longest bar.
const BAR: usize = 40;
/// Most of the heaviest limited sources listed (`--json` has them all).
const HEAVIEST: usize = 5;

fn f(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"))
}

/// The TOML of a proposal for `rule`'s limit `limit` (1: the rule's own keys).
#[must_use]
pub fn suggestion_toml(rule: &str, limit: u64, rate: u64, burst: u64) -> String {
    let place = if limit <= 1 {
        format!("# in the [[rule]] named {rule:?}")
    } else {
        format!(
            "# in [[rule.limit]] number {} of the rule named {rule:?}",
            limit - 1
        )
    };
    format!("{place}\nrate = {rate}\nburst = {burst}\n")
}

/// One suggestion.
fn one(out: &mut String, s: &Value, since: u64) {
    let rule = s["rule"].as_str().unwrap_or("?");
    let limit = s["limit"].as_u64().unwrap_or(1);
    let _ = writeln!(
        out,
        "rule {rule}, limit {limit}: {} sources seen in the last {}",
        cell(&s["sources"]),
        since_text(since)
    );
    let rows: Vec<Vec<String>> = [
        ("peak over 1 s (/s)", "peak_1s"),
        ("peak over 10 s (/s)", "peak_10s"),
        ("burst (packets)", "burst"),
    ]
    .iter()
    .map(|(name, key)| {
        let o = &s["observed"][key];
        vec![
            (*name).to_owned(),
            f(&o["p50"]),
            f(&o["p90"]),
            f(&o["p99"]),
            f(&o["p999"]),
            f(&o["max"]),
        ]
    })
    .collect();
    out.push_str(&table(&["", "P50", "P90", "P99", "P99.9", "MAX"], &rows));
    let empty = Vec::new();
    let bins = s["histogram"].as_array().unwrap_or(&empty);
    let most = bins
        .iter()
        .filter_map(|b| b["sources"].as_u64())
        .max()
        .unwrap_or(0);
    if let Some(most) = std::num::NonZeroU64::new(most) {
        let _ = writeln!(out, "10 s peak rates (sources per bin):");
        for b in bins {
            let n = b["sources"].as_u64().unwrap_or(0);
            let len = usize::try_from(n * BAR as u64 / most).unwrap_or(BAR);
            let _ = writeln!(
                out,
                "  <= {:>10}  {:<BAR$} {n}",
                f(&b["up_to"]),
                "#".repeat(len)
            );
        }
    }
    let p = &s["proposed"];
    let (rate, burst) = (
        p["rate"].as_u64().unwrap_or(0),
        p["burst"].as_u64().unwrap_or(0),
    );
    let now = match &s["current"] {
        Value::Object(c) => format!(
            " (now rate {}, burst {})",
            cell(&c["rate"]),
            cell(&c["burst"])
        ),
        _ => String::new(),
    };
    let _ = writeln!(out, "proposed: rate {rate}, burst {burst}{now}");
    let e = &s["effect"];
    let _ = writeln!(
        out,
        "it would have limited {} sources, {:.1}% of the peak traffic",
        cell(&e["limited_sources"]),
        e["limited_share"].as_f64().unwrap_or(0.0) * 100.0
    );
    heaviest(out, e["limited_heaviest"].as_array().unwrap_or(&empty));
    for r in s["reasons"].as_array().unwrap_or(&empty) {
        let _ = writeln!(out, "  {}", r.as_str().unwrap_or(""));
    }
    out.push_str(&suggestion_toml(rule, limit, rate, burst));
}

/// The heaviest sources a proposal would have limited, at most [`HEAVIEST`] of them, indented.
fn heaviest(out: &mut String, all: &[Value]) {
    if all.is_empty() {
        return;
    }
    let _ = writeln!(out, "the heaviest sources it would have limited:");
    let rows: Vec<Vec<String>> = all
        .iter()
        .take(HEAVIEST)
        .map(|h| {
            vec![
                cell(&h["source"]),
                f(&h["peak_1s"]),
                f(&h["peak_10s"]),
                f(&h["burst"]),
            ]
        })
        .collect();
    let header = ["SOURCE", "PEAK 1 S (/s)", "PEAK 10 S (/s)", "BURST"];
    for line in table(&header, &rows).lines() {
        let _ = writeln!(out, "  {line}");
    }
    if all.len() > HEAVIEST {
        let _ = writeln!(out, "  ... {} more in --json", all.len() - HEAVIEST);
    }
}

fn since_text(secs: u64) -> String {
    match secs {
        s if s % 3600 == 0 => format!("{} h", s / 3600),
        s if s % 60 == 0 => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}

/// `ratelimit suggest`.
#[must_use]
pub fn suggest(v: &Value) -> String {
    let empty = Vec::new();
    let all = v["suggestions"].as_array().unwrap_or(&empty);
    let since = v["since_secs"].as_u64().unwrap_or(0);
    if all.is_empty() {
        return format!(
            "nothing learned yet: no source of a rule sent in the last {}\n",
            since_text(since)
        );
    }
    let mut out = String::new();
    for (i, s) in all.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        one(&mut out, s, since);
    }
    out
}
