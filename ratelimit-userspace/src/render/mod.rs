//! Human output of the client commands: the API's JSON answers (see [`crate::api`]) as readable
//! tables and lines. `--json` prints the answers themselves; this is only for people.
//!
//! One file per answer that takes more than a line or two: `status.rs`, `rules.rs` (the rule
//! list and the answers to changes), `top.rs`, `explain.rs`, `stats.rs`, `peers.rs`, `suggest.rs`. This file
//! holds the cells and tables they all print with.

mod explain;
mod peers;
mod rules;
mod stats;
mod status;
mod suggest;
mod top;

use serde_json::Value;

pub use self::{
    explain::explain,
    peers::peers,
    rules::{added, detached, reloaded, removed, rules},
    stats::stats,
    status::status,
    suggest::{suggest, suggestion_toml},
    top::top,
};

/// A value for a cell: strings bare, numbers as written, absent or null as `-`.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        Value::Bool(b) => if *b { "yes" } else { "no" }.to_string(),
        other => other.to_string(),
    }
}

fn text<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("?")
}

fn num(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// Left-aligned columns separated by two spaces; numeric-looking columns right-aligned.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let numeric: Vec<bool> = (0..header.len())
        .map(|i| {
            rows.iter().all(|r| {
                let c = &r[i];
                c == "-" || c.parse::<f64>().is_ok()
            }) && !rows.is_empty()
        })
        .collect();
    aligned(header, rows, &numeric)
}

/// Columns separated by two spaces, right-aligned where `numeric` says so, else left-aligned.
fn aligned(header: &[&str], rows: &[Vec<String>], numeric: &[bool]) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, c) in width.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<String>| {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i > 0 {
                l.push_str("  ");
            }
            let pad = width[i].saturating_sub(c.chars().count());
            if numeric[i] {
                l.push_str(&" ".repeat(pad));
                l.push_str(c);
            } else {
                l.push_str(c);
                if i + 1 < cells.len() {
                    l.push_str(&" ".repeat(pad));
                }
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(header.iter().map(|h| (*h).to_string()).collect());
    for row in rows {
        line(row.clone());
    }
    out
}

fn rate(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| "-".to_string(), |f| format!("{f:.1}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let out = table(
            &["NAME", "RATE"],
            &[
                vec!["a".into(), "5".into()],
                vec!["long-name".into(), "1000".into()],
            ],
        );
        assert_eq!(out, "NAME       RATE\na             5\nlong-name  1000\n");
    }
}
