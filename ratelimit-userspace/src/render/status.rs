//! `ratelimit status`: the agent, its interfaces, rules, buckets, reloads, metrics endpoint and
//! cluster at a glance. Its own room because it reads the longest answer of the API.

use std::fmt::Write as _;

use serde_json::Value;

use super::{cell, num, text};

fn duration(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m{s:02}s"),
        (0, _, _) => format!("{h}h{m:02}m{s:02}s"),
        _ => format!("{d}d{h:02}h{m:02}m"),
    }
}

/// `ratelimit status`: one section of the status after the other, in the order it prints them.
#[must_use]
pub fn status(v: &Value) -> String {
    let mut out = String::new();
    let r = &v["reloads"];
    let mut rows = agent_rows(v);
    if let Some(e) = r["last_error"].as_str() {
        rows.push(("last refusal", e.to_string()));
    }
    let m = &v["metrics"];
    if m.is_object() {
        rows.push(("metrics", metrics_endpoint(m)));
    }
    rows.extend(cluster_rows(&v["cluster"]));
    if let Some(list) = r["restart_needed"].as_array().filter(|a| !a.is_empty()) {
        let keys: Vec<String> = list.iter().map(cell).collect();
        rows.push(("restart", format!("needed to apply: {}", keys.join(", "))));
    }
    for (k, val) in rows {
        let _ = writeln!(out, "{k:<12} {val}");
    }
    out
}

/// The attached interfaces with their mode (or why missing), comma-separated; `none (detached)`
/// without any.
fn interfaces(v: &Value) -> String {
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
    if ifaces.is_empty() {
        "none (detached)".to_string()
    } else {
        ifaces.join(", ")
    }
}

/// The rows every status has: the agent, its files, interfaces, rules, buckets and changes.
fn agent_rows(v: &Value) -> Vec<(&'static str, String)> {
    let r = &v["reloads"];
    vec![
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
        ("interfaces", interfaces(v)),
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
    ]
}

/// The metrics endpoint's line: where it serves, or why it does not yet.
fn metrics_endpoint(m: &Value) -> String {
    if text(m, "state") == "serving" {
        format!("serving at http://{}/metrics", text(m, "listen"))
    } else {
        format!(
            "NOT SERVING: {} ({} failed attempts to bind {}; retrying in the background)",
            m["error"].as_str().unwrap_or("not bound yet"),
            num(m, "bind_failures"),
            text(m, "listen"),
        )
    }
}

/// The `cluster` row, and the `store` row under a Redis store; none outside a cluster.
fn cluster_rows(cl: &Value) -> Vec<(&'static str, String)> {
    let mut rows = Vec::new();
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
        let store = &cl["store"];
        if store.is_object() {
            rows.push((
                "store",
                format!(
                    "redis {}{}",
                    text(store, "state"),
                    store["last_error"]
                        .as_str()
                        .filter(|_| store["state"] == "down")
                        .map_or_else(String::new, |e| format!(": {e}")),
                ),
            ));
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::status;

    /// Under `backend = "redis"` a `store` line: its state, and while down why.
    #[test]
    fn the_redis_store_is_shown_with_why_it_is_down() {
        let cluster = |store: serde_json::Value| {
            json!({"cluster": {"hosts_heard": 1, "hosts_known": 1, "gossip": "running",
                               "on_partition": "fail_open", "budget_share": 1.0, "store": store}})
        };
        let up = status(&cluster(
            json!({"state": "connected", "last_error": "broken pipe"}),
        ));
        assert!(
            up.lines().any(|l| l == "store        redis connected"),
            "{up}"
        );
        let down = status(&cluster(
            json!({"state": "down", "last_error": "connecting: Connection refused"}),
        ));
        assert!(
            down.lines()
                .any(|l| l == "store        redis down: connecting: Connection refused"),
            "{down}"
        );
        let gossip = status(&json!({"cluster": {"gossip": "running", "store": null}}));
        assert!(!gossip.contains("store"), "{gossip}");
    }
}
