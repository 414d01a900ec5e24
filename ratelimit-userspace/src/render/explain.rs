//! `ratelimit explain`: which rule a packet meets, why, and the state of its buckets. Its own
//! room because it reads the packet, the rule, every limit's bucket and the fragments' cut.

use std::fmt::Write as _;

use serde_json::Value;

use super::{cell, num, rate, text};

fn protocol_name(n: u64) -> String {
    match n {
        0 => "any".to_string(),
        1 | 58 => "icmp".to_string(),
        6 => "tcp".to_string(),
        17 => "udp".to_string(),
        n => format!("{n}"),
    }
}

/// `ratelimit explain`: one line of the report after the other, in the order it prints them.
#[must_use]
pub fn explain(v: &Value) -> String {
    let mut out = String::new();
    let mut rows = vec![("packet", packet(v))];
    rows.extend(rule_rows(v));
    if let Some(p) = v["prefix"].as_str() {
        rows.push(("prefix", p.to_string()));
        let c: Vec<String> = v["candidates"]
            .as_array()
            .map(|a| a.iter().map(cell).collect())
            .unwrap_or_default();
        rows.push(("candidates", c.join(", ")));
    }
    rows.push(("why", text(v, "why").to_string()));
    rows.extend(bucket_rows(v));
    let cut = &v["cut"];
    if cut.is_object() {
        let what = match cut["verdict"].as_str() {
            Some("rule") => format!("rule {}", text(cut, "rule")),
            Some(other) => other.to_string(),
            None => "?".to_string(),
        };
        rows.push(("fragments", format!("{what}: {}", text(cut, "why"))));
    }
    for (k, val) in rows {
        let _ = writeln!(out, "{k:<11} {val}");
    }
    out
}

/// The packet asked about: its address and protocol, and its port and TCP flags when given.
fn packet(v: &Value) -> String {
    let mut asked = format!(
        "{} protocol {}",
        text(v, "ip"),
        protocol_name(num(v, "protocol"))
    );
    if let Some(p) = v["dst_port"].as_u64() {
        let _ = write!(asked, " dst_port {p}");
    }
    if let Some(f) = v["tcp_flags"].as_u64() {
        let _ = write!(
            asked,
            " tcp_flags {}",
            crate::agent::flag_names(u8::try_from(f).unwrap_or(0))
        );
    }
    asked
}

/// The `rule` row (the rule met, or none), and its `settings` row when its config is given.
fn rule_rows(v: &Value) -> Vec<(&'static str, String)> {
    let mut rows = Vec::new();
    match v["rule"].as_object() {
        None => rows.push(("rule", "none: the packet passes".to_string())),
        Some(rule) => {
            let line = rule.get("line").and_then(Value::as_u64).unwrap_or(0);
            let place = if line > 0 {
                format!(", line {line}")
            } else {
                String::new()
            };
            rows.push((
                "rule",
                format!("{} (id {}{place})", cell(&rule["name"]), cell(&rule["id"])),
            ));
            if let Some(c) = rule.get("config").filter(|c| c.is_object()) {
                rows.push(("settings", settings(c)));
            }
        }
    }
    rows
}

/// A rule's settings that are set, as `key=value` separated by spaces, then `dry_run` if on.
fn settings(c: &Value) -> String {
    let keys = [
        "action",
        "rate",
        "burst",
        "per",
        "bytes_rate",
        "bytes_burst",
        "protocol",
        "dst_port",
        "tcp_flags",
        "scope",
    ];
    let settings: Vec<String> = keys
        .iter()
        .filter(|k| !c[**k].is_null())
        .map(|k| format!("{k}={}", cell(&c[*k])))
        .chain(
            c["dry_run"]
                .as_bool()
                .filter(|d| *d)
                .map(|_| "dry_run".to_string()),
        )
        .collect();
    settings.join(" ")
}

/// A bucket's tokens, counts and age, or that none is tracked.
fn bucket_text(b: &Value) -> String {
    if b.is_object() {
        let mut parts = Vec::new();
        if !b["tokens"].is_null() {
            parts.push(format!("{} tokens", rate(&b["tokens"])));
        }
        if !b["byte_tokens"].is_null() {
            parts.push(format!("{} byte tokens", rate(&b["byte_tokens"])));
        }
        parts.push(format!("passed {}", num(b, "passed")));
        parts.push(format!("dropped {}", num(b, "dropped")));
        parts.push(format!("age {} s", rate(&b["age_secs"])));
        parts.join(", ")
    } else {
        "none tracked (no recent packet from this source under this rule: a full bucket)"
            .to_string()
    }
}

/// The `bucket` rows under a rule: one per limit when it has more than one, else its bucket.
fn bucket_rows(v: &Value) -> Vec<(&'static str, String)> {
    let mut rows = Vec::new();
    let mut limit_rows = Vec::new();
    if v["rule"].is_object() {
        let limits = v["limits"].as_array().map_or(&[][..], Vec::as_slice);
        if limits.len() > 1 {
            // Every limit's bucket: the packet passes only if each has a token.
            for l in limits {
                limit_rows.push(format!(
                    "limit {} (per {}, bucket {}): {}",
                    num(l, "limit"),
                    text(l, "per"),
                    text(l, "key"),
                    bucket_text(&l["bucket"])
                ));
            }
        } else {
            rows.push(("bucket", bucket_text(&v["bucket"])));
        }
    }
    for r in limit_rows {
        rows.push(("bucket", r));
    }
    rows
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn explain_lines() {
        let v = json!({"ip": "198.18.1.5", "protocol": 17, "dst_port": 53, "rule": null, "prefix": null,
                       "candidates": [], "why": "no rule's source prefix contains this address: the packet passes", "bucket": null,
                       "cut": {"verdict": "passed", "rule": null, "why": "no rule"}});
        assert_eq!(
            explain(&v),
            "packet      198.18.1.5 protocol udp dst_port 53\nrule        none: the packet passes\n\
             why         no rule's source prefix contains this address: the packet passes\n\
             fragments   passed: no rule\n"
        );
        let v = json!({"ip": "198.18.1.5", "protocol": 0, "rule": null, "why": "w",
                       "cut": {"verdict": "rule", "rule": "web", "why": "no port rule"}});
        assert!(
            explain(&v).ends_with("fragments   rule web: no port rule\n"),
            "{}",
            explain(&v)
        );
    }
}
