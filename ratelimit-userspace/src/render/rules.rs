//! `ratelimit rules list` and the answers to the commands that change the rules in force
//! (`rules add`, `rules remove`, `rules reload`, `detach`).

use std::fmt::Write as _;

use serde_json::Value;

use super::{cell, num, table};

/// A rule's `source` for a table cell.
fn sources(rule: &Value) -> String {
    match (&rule["source"], rule.get("source_file")) {
        (Value::String(s), _) => s.clone(),
        (Value::Array(list), _) if list.len() <= 3 => {
            list.iter().map(cell).collect::<Vec<_>>().join(",")
        }
        (Value::Array(list), _) => format!("{} prefixes ({},...)", list.len(), cell(&list[0])),
        (_, Some(file)) => format!("file {}", cell(file)),
        _ => "-".to_string(),
    }
}

/// `ratelimit rules list`.
#[must_use]
pub fn rules(v: &Value) -> String {
    let empty = Vec::new();
    let rules = v["rules"].as_array().unwrap_or(&empty);
    if rules.is_empty() {
        return "no rules: every packet passes\n".to_string();
    }
    let keys = ["rate", "burst", "per", "bytes_rate", "bytes_burst", "scope"];
    let rows: Vec<Vec<String>> = rules
        .iter()
        .map(|r| {
            let mut row = vec![
                cell(&r["name"]),
                sources(r),
                cell(&r["action"]),
                cell(&r["protocol"]),
                cell(&r["dst_port"]),
                cell(&r["tcp_flags"]),
            ];
            row.extend(keys.iter().map(|k| cell(&r[*k])));
            row.push(cell(&r["dry_run"]));
            row
        })
        .collect();
    table(
        &[
            "NAME",
            "SOURCE",
            "ACTION",
            "PROTOCOL",
            "DST_PORT",
            "TCP_FLAGS",
            "RATE",
            "BURST",
            "PER",
            "BYTES_RATE",
            "BYTES_BURST",
            "SCOPE",
            "DRY_RUN",
        ],
        &rows,
    )
}

fn rules_count(n: u64) -> String {
    format!("{n} rule{}", if n == 1 { "" } else { "s" })
}

/// The answer to `ratelimit rules add`.
#[must_use]
pub fn added(v: &Value) -> String {
    format!(
        "added rule {} ({} in force)\n",
        v["added"]["name"],
        rules_count(num(v, "rules"))
    )
}

/// The answer to `ratelimit rules remove`.
#[must_use]
pub fn removed(v: &Value) -> String {
    format!(
        "removed rule {} ({} in force)\n",
        v["removed"],
        rules_count(num(v, "rules"))
    )
}

/// The answer to `ratelimit rules reload`.
#[must_use]
pub fn reloaded(v: &Value) -> String {
    let mut out = format!(
        "reloaded the config file: {} in force\n",
        rules_count(num(v, "rules"))
    );
    if let Some(list) = v["restart_needed"].as_array().filter(|a| !a.is_empty()) {
        let keys: Vec<String> = list.iter().map(cell).collect();
        let _ = writeln!(
            out,
            "changed settings that take effect on restart: {}",
            keys.join(", ")
        );
    }
    out
}

/// The answer to `ratelimit detach`.
#[must_use]
pub fn detached(v: &Value) -> String {
    let list: Vec<String> = v["detached"]
        .as_array()
        .map(|a| a.iter().map(cell).collect())
        .unwrap_or_default();
    if list.is_empty() {
        "was not attached to any interface\n".to_string()
    } else {
        format!("detached from {}\n", list.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn rules_table() {
        let v = json!({"rules": [
            {"name": "dns", "source": "::/0", "action": "limit", "rate": 100, "burst": 100, "per": "source",
             "protocol": "udp", "dst_port": 53, "scope": "local", "dry_run": false},
            {"name": "office", "source": ["198.51.100.0/24", "2001:db8::/32"], "action": "allow", "protocol": "any", "dry_run": false},
        ]});
        let out = rules(&v);
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("NAME    SOURCE"), "{out}");
        assert!(lines[1].starts_with("dns     ::/0 "), "{out}");
        assert!(
            lines[2].contains("198.51.100.0/24,2001:db8::/32  allow"),
            "{out}"
        );
        assert_eq!(
            rules(&json!({"rules": []})),
            "no rules: every packet passes\n"
        );
    }
}
