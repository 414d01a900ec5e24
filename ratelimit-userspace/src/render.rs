//! Human output of the client commands: the API's JSON answers (see [`crate::api`]) as readable
//! tables and lines. `--json` prints the answers themselves; this is only for people.

use std::{collections::BTreeMap, fmt::Write as _};

use ratelimit_common::{global, verdict};
use serde_json::Value;

use crate::stats::{BucketReport, RuleReport, StatsReport};

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

fn duration(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m{s:02}s"),
        (0, _, _) => format!("{h}h{m:02}m{s:02}s"),
        _ => format!("{d}d{h:02}h{m:02}m"),
    }
}

/// `ratelimit status`.
#[must_use]
pub fn status(v: &Value) -> String {
    let mut out = String::new();
    let ifaces: Vec<String> = v["interfaces"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|i| match text(i, "state") {
                    "missing" => format!(
                        "{} (missing: deleted; attached again when it returns)",
                        text(i, "iface")
                    ),
                    _ => format!("{} ({})", text(i, "iface"), text(i, "mode")),
                })
                .collect()
        })
        .unwrap_or_default();
    let r = &v["reloads"];
    let mut rows = vec![
        (
            "agent",
            format!(
                "running, pid {}, version {}, up {}",
                num(v, "pid"),
                text(v, "version"),
                duration(num(v, "uptime_secs"))
            ),
        ),
        ("config", text(v, "config").to_string()),
        ("socket", text(v, "socket").to_string()),
        ("pin path", text(v, "pin_path").to_string()),
        (
            "interfaces",
            if ifaces.is_empty() {
                "none (detached)".to_string()
            } else {
                ifaces.join(", ")
            },
        ),
        (
            "rules",
            format!(
                "{} over {} source prefixes (generation {})",
                num(v, "rules"),
                num(v, "prefixes"),
                num(v, "generation")
            ),
        ),
        ("dry run", cell(&v["dry_run"])),
        (
            "buckets",
            format!(
                "{} tracked of {}; evicted for new sources: {} full, {} lost",
                num(v, "buckets_tracked"),
                num(v, "buckets_capacity"),
                num(&v["buckets_evicted"], "full"),
                num(&v["buckets_evicted"], "lost")
            ),
        ),
        (
            "changes",
            format!("{} applied, {} refused", num(r, "ok"), num(r, "failed")),
        ),
    ];
    if let Some(e) = r["last_error"].as_str() {
        rows.push(("last refusal", e.to_string()));
    }
    let m = &v["metrics"];
    if m.is_object() {
        rows.push((
            "metrics",
            if text(m, "state") == "serving" {
                format!("serving at http://{}/metrics", text(m, "listen"))
            } else {
                format!(
                    "NOT SERVING: {} ({} failed attempts to bind {}; retrying in the background)",
                    m["error"].as_str().unwrap_or("not bound yet"),
                    num(m, "bind_failures"),
                    text(m, "listen"),
                )
            },
        ));
    }
    let cl = &v["cluster"];
    if cl.is_object() {
        rows.push((
            "cluster",
            format!(
                "{} of {} hosts heard (last known alive), gossip {}; on_partition {}: enforcing {:.3} of each cluster budget",
                num(cl, "hosts_heard"),
                num(cl, "hosts_known"),
                text(cl, "gossip"),
                text(cl, "on_partition"),
                cl["budget_share"].as_f64().unwrap_or(1.0),
            ),
        ));
    }
    if let Some(list) = r["restart_needed"].as_array().filter(|a| !a.is_empty()) {
        let keys: Vec<String> = list.iter().map(cell).collect();
        rows.push(("restart", format!("needed to apply: {}", keys.join(", "))));
    }
    for (k, val) in rows {
        let _ = writeln!(out, "{k:<12} {val}");
    }
    out
}

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

fn rate(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| "-".to_string(), |f| format!("{f:.1}"))
}

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

fn protocol_name(n: u64) -> String {
    match n {
        0 => "any".to_string(),
        1 | 58 => "icmp".to_string(),
        6 => "tcp".to_string(),
        17 => "udp".to_string(),
        n => format!("{n}"),
    }
}

/// `ratelimit explain`.
#[must_use]
pub fn explain(v: &Value) -> String {
    let mut out = String::new();
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
    let mut rows = vec![("packet", asked)];
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
                rows.push(("settings", settings.join(" ")));
            }
        }
    }
    if let Some(p) = v["prefix"].as_str() {
        rows.push(("prefix", p.to_string()));
        let c: Vec<String> = v["candidates"]
            .as_array()
            .map(|a| a.iter().map(cell).collect())
            .unwrap_or_default();
        rows.push(("candidates", c.join(", ")));
    }
    rows.push(("why", text(v, "why").to_string()));
    let bucket_text = |b: &Value| {
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
    };
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

/// The heaviest keys' holders (`keys` of `peers`): per key its hosts and cluster demand, then a
/// line per holder (this host, `me`, first) with its demand and share. Empty without keys.
fn key_shares(v: &Value, me: &str) -> String {
    let keys = v["keys"].as_array().map_or(&[][..], Vec::as_slice);
    if keys.is_empty() {
        return String::new();
    }
    let f = |x: &Value, digits: usize| {
        x.as_f64()
            .map_or_else(|| "-".to_string(), |n| format!("{n:.digits$}"))
    };
    let mut rows = Vec::new();
    for k in keys {
        let holders = k["holders"].as_array().map_or(&[][..], Vec::as_slice);
        let mut first = vec![
            text(k, "rule").to_string(),
            cell(&k["limit"]),
            text(k, "key").to_string(),
            cell(&k["hosts"]),
            f(&k["demand_pps"], 1),
        ];
        let mut lines: Vec<[String; 3]> = holders
            .iter()
            .map(|h| {
                let node = text(h, "node_id");
                let name = if node == me {
                    format!("{node} (this host)")
                } else {
                    node.to_string()
                };
                [name, f(&h["demand_pps"], 1), f(&h["share"], 3)]
            })
            .collect();
        let idle = num(k, "idle_holders");
        if idle > 0 {
            lines.push([
                format!("{idle} idle holder(s), each"),
                "0.0".to_string(),
                f(&k["idle_share"], 3),
            ]);
        }
        for (i, [holder, demand, share]) in lines.into_iter().enumerate() {
            let mut row = if i == 0 {
                std::mem::take(&mut first)
            } else {
                vec![String::new(); 5]
            };
            row.extend([holder, demand, share]);
            rows.push(row);
        }
    }
    let mut out = String::from(
        "heaviest keys whose share this host sets (share: the part of the budget a holder's \
         bucket refills at):\n",
    );
    out.push_str(&aligned(
        &[
            "RULE", "LIMIT", "KEY", "HOSTS", "DEMAND/S", "HOLDER", "DEMAND/S", "SHARE",
        ],
        &rows,
        &[false, true, false, true, true, false, true, true],
    ));
    out
}

/// `peers`: the cluster's members, the heaviest keys' holders and the gossip counters.
#[must_use]
pub fn peers(v: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cluster {} as {} (generation {}), listening on {}, sync every {} ms, peers silent after {} ms",
        v["cluster_id"].as_str().unwrap_or("?"),
        v["node_id"].as_str().unwrap_or("?"),
        v["generation"],
        v["listen"].as_str().unwrap_or("-"),
        v["sync_interval_ms"],
        v["peer_timeout_ms"],
    );
    let peers = v["peers"].as_array().cloned().unwrap_or_default();
    if peers.is_empty() {
        let _ = writeln!(
            out,
            "no peers heard yet: this host enforces its limits on its own"
        );
    } else {
        let _ = writeln!(
            out,
            "{:<32} {:<21} {:<8} {:>7} {:>10} {:>8} {:>6} {:>12}",
            "NODE", "ADDR", "STATE", "COUNTED", "HEARD", "LAG", "KEYS", "CHARGED"
        );
        for p in &peers {
            let ms = |x: &Value| {
                x.as_i64()
                    .map_or_else(|| "-".to_string(), |m| format!("{m} ms"))
            };
            let _ = writeln!(
                out,
                "{:<32} {:<21} {:<8} {:>7} {:>10} {:>8} {:>6} {:>12}",
                p["node_id"].as_str().unwrap_or("?"),
                p["addr"].as_str().unwrap_or("?"),
                p["state"].as_str().unwrap_or("?"),
                if p["counted"].as_bool() == Some(true) {
                    "yes"
                } else {
                    "no"
                },
                ms(&p["last_heard_ms"]),
                ms(&p["lag_ms"]),
                p["keys"],
                p["charged_pkts"],
            );
        }
    }
    out.push_str(&key_shares(v, v["node_id"].as_str().unwrap_or("?")));
    let c = &v["counters"];
    let _ = writeln!(
        out,
        "gossip: {} in / {} out messages, {} / {} bytes; rejected {} auth, {} stale, {} malformed; \
         keys published {}, synced {}; charged {} packets; sync lag {} ms; rounds late {}",
        c["messages_in"], c["messages_out"], c["bytes_in"], c["bytes_out"], c["rejected_auth"],
        c["rejected_stale"], c["rejected_malformed"], c["keys_published"], c["keys_synced"],
        c["charged_pkts"], c["sync_lag_ms"], c["rounds_late"],
    );
    if v["gossip"].as_str() == Some("restarting") {
        let _ = writeln!(
            out,
            "gossip: RESTARTING ({}); peers are not heard meanwhile; restarts {}",
            v["gossip_error"].as_str().unwrap_or("?"),
            c["gossip_restarts"],
        );
    } else if c["gossip_restarts"].as_u64().unwrap_or(0) > 0 {
        let _ = writeln!(out, "gossip: running; restarts {}", c["gossip_restarts"]);
    }
    let _ = writeln!(
        out,
        "hosts: {} heard of {} last known alive; on_partition {}: enforcing {:.3} of each cluster budget",
        v["hosts_heard"],
        v["hosts_known"],
        v["on_partition"].as_str().unwrap_or("?"),
        v["budget_share"].as_f64().unwrap_or(1.0),
    );
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

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

    /// `peers --json` carries the heaviest keys with their holders beside the old fields, and
    /// `peers` prints them after the members: per key its hosts and cluster demand, then each
    /// holder (this host first) with its demand and share, idle holders on a line of their own.
    #[test]
    fn peers_shows_each_holders_demand_and_share() {
        use crate::cluster::{
            status::{HeaviestKeys, KeyRound},
            ClusterStatus, PeerStatus,
        };
        let name = |addr: [u8; 4], limit: u8| crate::cluster::publish::KeyName {
            rule: "flood".into(),
            limit,
            addr: std::net::IpAddr::from(addr),
        };
        let b = chitchat::ChitchatId::new("b/192.0.2.2:7946", 7, ([192, 0, 2, 2], 7946).into());
        let source = ratelimit_common::Limit {
            src_mask: [u32::MAX, 0, 0, 0],
            ..Default::default()
        };
        let per_rule = ratelimit_common::Limit::default();
        let mut keys = HeaviestKeys::default();
        let (heavy, light) = (name([198, 18, 0, 7], 0), name([0, 0, 0, 0], 1));
        let b_demand = [(b.clone(), 1500.0)];
        keys.offer(&KeyRound {
            name: &heavy,
            limit: &source,
            demand: 500.0,
            share: 0.25,
            hosts: 2,
            peers: &b_demand,
            factor: 1.0,
            rate: Some(1000.0),
        });
        keys.offer(&KeyRound {
            name: &light,
            limit: &per_rule,
            demand: 100.0,
            share: 0.55,
            hosts: 2,
            peers: &[],
            factor: 1.0,
            rate: Some(1000.0),
        });
        let status = ClusterStatus {
            cluster_id: "c".into(),
            node_id: "a/192.0.2.1:7946".into(),
            generation: 5,
            listen: Some("192.0.2.1:7946".parse().unwrap()),
            peers: vec![PeerStatus {
                node_id: "b/192.0.2.2:7946".into(),
                generation: 7,
                addr: "192.0.2.2:7946".parse().unwrap(),
                state: "alive",
                counted: true,
                last_heard_ms: Some(20),
                lag_ms: Some(110),
                keys: 1,
                stored_keys: 2,
                charged_pkts: 9,
                charged_bytes: 0,
                clamped: 0,
            }],
            keys: keys.into_status("a/192.0.2.1:7946", 5),
            ..ClusterStatus::default()
        };
        let v = serde_json::to_value(&status).unwrap();
        assert_eq!(v["peers"][0]["charged_pkts"], 9, "old fields kept: {v:#}");
        assert_eq!(
            v["keys"][0],
            json!({"rule": "flood", "limit": 1, "key": "198.18.0.7/32", "hosts": 2,
                   "demand_pps": 2000.0, "idle_holders": 0, "idle_share": 0.0,
                   "holders": [
                       {"node_id": "a/192.0.2.1:7946", "generation": 5, "demand_pps": 500.0, "share": 0.25},
                       {"node_id": "b/192.0.2.2:7946", "generation": 7, "demand_pps": 1500.0, "share": 0.75}]})
        );
        assert_eq!(
            (
                &v["keys"][1]["key"],
                &v["keys"][1]["limit"],
                &v["keys"][1]["idle_holders"]
            ),
            (&json!("0.0.0.0/0"), &json!(2), &json!(1))
        );
        let out = peers(&v);
        let lines: Vec<&str> = out.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.starts_with("heaviest keys"))
            .unwrap_or_else(|| panic!("no key table:\n{out}"));
        assert!(
            lines[at - 1].starts_with("b/192.0.2.2:7946"),
            "after the members:\n{out}"
        );
        assert_eq!(
            lines[at + 1..at + 6],
            [
                "RULE   LIMIT  KEY            HOSTS  DEMAND/S  HOLDER                        DEMAND/S  SHARE",
                "flood      1  198.18.0.7/32      2    2000.0  a/192.0.2.1:7946 (this host)     500.0  0.250",
                "                                              b/192.0.2.2:7946                1500.0  0.750",
                "flood      2  0.0.0.0/0          2     100.0  a/192.0.2.1:7946 (this host)     100.0  0.550",
                "                                              1 idle holder(s), each             0.0  0.450",
            ],
            "{out}"
        );
        assert!(lines[at + 6].starts_with("gossip:"), "{out}");
        // Without keys, no table.
        let mut quiet = v.clone();
        quiet["keys"] = json!([]);
        assert!(!peers(&quiet).contains("heaviest keys"));
    }

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
