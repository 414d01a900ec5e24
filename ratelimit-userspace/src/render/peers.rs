//! `ratelimit peers`: the cluster's members, the heaviest keys' holders and shares, and the
//! gossip counters. Its own room because it reads the cluster sync's status alone.

use std::fmt::Write as _;

use serde_json::Value;

use super::{aligned, cell, num, text};

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
    out.push_str(&members(v));
    out.push_str(&key_shares(v, v["node_id"].as_str().unwrap_or("?")));
    let s = &v["store"];
    if s.is_object() {
        out.push_str(&store(s));
    }
    out.push_str(&gossip(v));
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

/// The other members (`peers` of `peers`), a line each under a header, or that none is heard.
fn members(v: &Value) -> String {
    let mut out = String::new();
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
                // A JSON value's `Display` ignores the width: print its text.
                p["keys"].to_string(),
                p["charged_pkts"].to_string(),
            );
        }
    }
    out
}

/// The Redis store's line: its addresses, mode, state, round trip, rounds, errors and last error.
fn store(s: &Value) -> String {
    let mut out = String::new();
    let addrs: Vec<&str> = s["addresses"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let shards = s["shards"]
        .as_u64()
        .map_or_else(String::new, |n| format!(", {n} shards"));
    let rtt = s["rtt_ms"]
        .as_f64()
        .map_or_else(|| "-".to_string(), |m| format!("{m:.1} ms"));
    let _ = writeln!(
        out,
        "store: redis {} ({}{shards}), {}; round trip {rtt}; {} rounds, {} errors{}",
        addrs.join(" "),
        s["mode"].as_str().unwrap_or("?"),
        s["state"].as_str().unwrap_or("?"),
        s["round_trips"],
        s["errors"],
        s["last_error"]
            .as_str()
            .map_or_else(String::new, |e| format!("; last error: {e}")),
    );
    out
}

/// The gossip counters' line, then the gossip loop's state when it is restarting or has restarted.
fn gossip(v: &Value) -> String {
    let mut out = String::new();
    let c = &v["counters"];
    let _ = writeln!(
        out,
        "gossip: {} in / {} out messages, {} / {} bytes; rejected {} auth, {} stale, {} malformed, \
         {} late; keys published {}, synced {}; charged {} packets; sync lag {} ms; rounds late {}",
        c["messages_in"], c["messages_out"], c["bytes_in"], c["bytes_out"], c["rejected_auth"],
        c["rejected_stale"], c["rejected_malformed"], c["rejected_late"], c["keys_published"], c["keys_synced"],
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
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Two hosts, `a` (this one) and its counted peer `b`: a heavy source key both hold and a
    /// per-rule key only `a` holds, with an idle holder.
    fn two_holders() -> crate::cluster::ClusterStatus {
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
        ClusterStatus {
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
        }
    }

    /// `peers --json` carries the heaviest keys with their holders beside the old fields, and
    /// `peers` prints them after the members: per key its hosts and cluster demand, then each
    /// holder (this host first) with its demand and share, idle holders on a line of their own.
    #[test]
    fn peers_shows_each_holders_demand_and_share() {
        let status = two_holders();
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
        // Every column of the member table ends where its header does, the numbers too.
        let header = lines[at - 2];
        assert!(header.starts_with("NODE "), "{out}");
        assert_eq!(header.len(), lines[at - 1].len(), "{out}");
        for (name, value) in [("KEYS", "1"), ("CHARGED", "9")] {
            let end = header.find(name).unwrap() + name.len();
            assert_eq!(
                &lines[at - 1][end - value.len()..end],
                value,
                "{name}:\n{out}"
            );
        }
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
        // No store line under gossip; under Redis, the store with its state and last error.
        assert!(!out.contains("store:"), "{out}");
        let mut redis = status.clone();
        redis.store = Some(crate::cluster::status::StoreStatus {
            addresses: vec!["redis://192.0.2.9:6379".into()],
            mode: "cluster",
            shards: Some(3),
            state: "down",
            rtt_ms: Some(0.84),
            round_trips: 120,
            errors: 4,
            last_error: Some("connecting: Connection refused".into()),
            last_error_unix_ms: Some(1),
        });
        let out = peers(&serde_json::to_value(&redis).unwrap());
        assert!(
            out.lines().any(|l| l
                == "store: redis redis://192.0.2.9:6379 (cluster, 3 shards), down; round trip \
                    0.8 ms; 120 rounds, 4 errors; last error: connecting: Connection refused"),
            "{out}"
        );
    }
}
