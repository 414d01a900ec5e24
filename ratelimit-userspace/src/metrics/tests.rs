use std::collections::BTreeMap;

use super::*;
use crate::stats::{BucketReport, RuleReport};
use ratelimit_common::verdict;

fn snapshot() -> Snapshot {
    let mut packets: BTreeMap<&'static str, u64> = verdict::NAMES.iter().map(|v| (*v, 0)).collect();
    packets.insert("passed", 100);
    packets.insert("dropped_rate", 200);
    let mut bytes: BTreeMap<&'static str, u64> = verdict::NAMES.iter().map(|v| (*v, 0)).collect();
    bytes.insert("passed", 10_600);
    let global = global::NAMES
        .iter()
        .enumerate()
        .filter(|(_, n)| !n.is_empty())
        .map(|(i, n)| (*n, i as u64 * 10))
        .collect();
    Snapshot {
        version: "1.2.3".into(),
        encodings: 4,
        stats: StatsReport {
            global,
            rules: vec![RuleReport {
                id: 3,
                name: "web \"edge\"".into(),
                line: 7,
                packets,
                bytes,
                limits: vec![
                    crate::stats::LimitReport {
                        limit: 1,
                        per: "source".into(),
                        dropped_rate: 150,
                        dropped_bytes: 0,
                    },
                    crate::stats::LimitReport {
                        limit: 2,
                        per: "/24".into(),
                        dropped_rate: 50,
                        dropped_bytes: 0,
                    },
                ],
            }],
            buckets: BucketReport {
                tracked: 5,
                capacity: 4096,
            },
        },
        reloads_ok: 2,
        reloads_failed: 1,
        interfaces: vec![
            InterfaceSnapshot {
                name: "eth0".into(),
                mode: "native".into(),
                rx_packets: Some(42),
                rx_dropped: Some(0),
            },
            InterfaceSnapshot {
                name: "gone".into(),
                mode: "skb".into(),
                rx_packets: None,
                rx_dropped: None,
            },
        ],
        cluster: Some(crate::cluster::ClusterStatus {
            peers: vec![crate::cluster::PeerStatus {
                stored_keys: 3,
                node_id: "b".into(),
                generation: 1,
                addr: "192.0.2.2:7946".parse().unwrap(),
                state: "alive",
                counted: true,
                last_heard_ms: Some(10),
                lag_ms: Some(120),
                keys: 3,
                charged_pkts: 7,
                charged_bytes: 700,
                clamped: 0,
            }],
            counters: crate::cluster::CounterValues {
                rejected_auth: 4,
                messages_in: 9,
                sync_lag_ms: 250,
                share_charged_pkts: 66,
                ..Default::default()
            },
            on_partition: "share",
            hosts_heard: 1,
            hosts_known: 3,
            budget_share: 0.5,
            ..Default::default()
        }),
        learned: vec![crate::learn::Gauges {
            rule: "web".into(),
            limit: 2,
            sources: 17,
            peak_1s: [1.0, 2.0, 3.0],
            peak_10s: [0.5, 1.5, 2.5],
            burst: [4.0, 5.0, 6.0],
        }],
    }
}

#[test]
fn encodes_the_documented_names() {
    let text = snapshot().encode().unwrap();
    for line in [
        r#"ratelimit_rule_packets_total{rule="web \"edge\"",verdict="passed"} 100"#,
        r#"ratelimit_limit_dropped_packets_total{rule="web \"edge\"",limit="1",verdict="dropped_rate"} 150"#,
        r#"ratelimit_limit_dropped_packets_total{rule="web \"edge\"",limit="2",verdict="dropped_rate"} 50"#,
        r#"ratelimit_limit_dropped_packets_total{rule="web \"edge\"",limit="2",verdict="dropped_bytes"} 0"#,
        r#"ratelimit_rule_packets_total{rule="web \"edge\"",verdict="dropped_rate"} 200"#,
        r#"ratelimit_rule_packets_total{rule="web \"edge\"",verdict="no_bucket"} 0"#,
        r#"ratelimit_rule_bytes_total{rule="web \"edge\"",verdict="passed"} 10600"#,
        "ratelimit_packets_total 0",
        "ratelimit_non_ip_packets_total 10",
        r#"ratelimit_parse_failures_total{reason="truncated_eth"} 20"#,
        r#"ratelimit_parse_failures_total{reason="truncated_l4"} 70"#,
        "ratelimit_fragments_total 80",
        "ratelimit_unmatched_packets_total 90",
        "ratelimit_new_buckets_total 100",
        "ratelimit_bucket_errors_total 110",
        "ratelimit_internal_errors_total 120",
        r#"ratelimit_bucket_evictions_total{state="full"} 130"#,
        r#"ratelimit_bucket_evictions_total{state="lost"} 140"#,
        "ratelimit_fragments_unmatched_total 150",
        r#"ratelimit_shape_drops_total{reason="tiny_fragment"} 160"#,
        r#"ratelimit_shape_drops_total{reason="long_header_chain"} 170"#,
        r#"ratelimit_shape_drops_total{reason="fragment_conflict"} 180"#,
        r#"ratelimit_shape_drops_total{reason="vlan_chain"} 210"#,
        r#"ratelimit_shape_drops_total{reason="unmatched_fragment"} 220"#,
        "ratelimit_long_header_chains_total 190",
        "ratelimit_buckets_tracked 5",
        "ratelimit_buckets_capacity 4096",
        r#"ratelimit_reloads_total{result="ok"} 2"#,
        r#"ratelimit_reloads_total{result="failed"} 1"#,
        r#"ratelimit_build_info{version="1.2.3"} 1"#,
        r#"ratelimit_interface_attached{interface="eth0",mode="native"} 1"#,
        r#"ratelimit_interface_attached{interface="gone",mode="skb"} 1"#,
        r#"ratelimit_interface_rx_packets_total{interface="eth0"} 42"#,
        r#"ratelimit_interface_rx_dropped_total{interface="eth0"} 0"#,
        r#"ratelimit_cluster_messages_total{direction="in"} 9"#,
        r#"ratelimit_cluster_rejected_total{reason="auth"} 4"#,
        r#"ratelimit_cluster_peers{state="alive"} 1"#,
        r#"ratelimit_cluster_peers{state="dead"} 0"#,
        "ratelimit_cluster_sync_lag_seconds 0.25",
        r#"ratelimit_cluster_hosts{view="heard"} 1"#,
        r#"ratelimit_cluster_hosts{view="known"} 3"#,
        "ratelimit_cluster_budget_share 0.5",
        "ratelimit_cluster_share_charged_packets_total 66",
        r#"ratelimit_learned_peak_rate{rule="web",limit="2",window="10s",quantile="0.99"} 2.5"#,
        r#"ratelimit_learned_peak_rate{rule="web",limit="2",window="1s",quantile="0.5"} 1.0"#,
        r#"ratelimit_learned_burst{rule="web",limit="2",quantile="0.9"} 5.0"#,
        "ratelimit_learned_sources{rule=\"web\",limit=\"2\"} 17",
        "# TYPE ratelimit_rule_packets counter",
        "# TYPE ratelimit_buckets_tracked gauge",
        "# TYPE ratelimit_build info",
        "# EOF",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
    assert!(
        !text.contains(r#"interface="gone"} "#),
        "unreadable counters are left out:\n{text}"
    );
    assert_eq!(
        text.matches("ratelimit_rule_packets_total{").count(),
        verdict::COUNT
    );
}

/// The heaviest keys' gauges: hosts per key, and per holder (this host and each peer with
/// demand, by node id) its demand and share; no key, no sample.
#[test]
fn cluster_key_gauges_name_each_holder() {
    let holder = |node: &str, demand_pps: f64, share: f64| crate::cluster::HolderStatus {
        node_id: node.into(),
        generation: 1,
        demand_pps,
        share,
    };
    let text = snapshot().encode().unwrap();
    assert!(!text.contains("ratelimit_cluster_key_"), "{text}");
    let mut s = snapshot();
    s.cluster.as_mut().unwrap().keys = vec![crate::cluster::KeyStatus {
        rule: "flood".into(),
        limit: 1,
        key: "198.18.0.7/32".into(),
        hosts: 3,
        demand_pps: 2000.0,
        holders: vec![
            holder("a/192.0.2.1:7946", 500.0, 0.25),
            holder("b/192.0.2.2:7946", 1500.0, 0.75),
        ],
        idle_holders: 1,
        idle_share: 0.0,
    }];
    let text = s.encode().unwrap();
    for line in [
        r#"ratelimit_cluster_key_hosts{rule="flood",limit="1",key="198.18.0.7/32"} 3"#,
        r#"ratelimit_cluster_key_demand_pps{rule="flood",limit="1",key="198.18.0.7/32",holder="a/192.0.2.1:7946"} 500.0"#,
        r#"ratelimit_cluster_key_demand_pps{rule="flood",limit="1",key="198.18.0.7/32",holder="b/192.0.2.2:7946"} 1500.0"#,
        r#"ratelimit_cluster_key_share{rule="flood",limit="1",key="198.18.0.7/32",holder="a/192.0.2.1:7946"} 0.25"#,
        r#"ratelimit_cluster_key_share{rule="flood",limit="1",key="198.18.0.7/32",holder="b/192.0.2.2:7946"} 0.75"#,
        "# TYPE ratelimit_cluster_key_share gauge",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
    assert_eq!(text.matches("ratelimit_cluster_key_share{").count(), 2);
}

#[test]
fn empty_families_are_left_out() {
    let text = Snapshot::default().encode().unwrap();
    assert!(!text.contains("ratelimit_rule_packets"), "{text}");
    assert!(!text.contains("ratelimit_interface_attached"), "{text}");
    assert!(text.contains("ratelimit_buckets_tracked 0"), "{text}");
    assert!(
        text.contains(r#"ratelimit_reloads_total{result="failed"} 0"#),
        "{text}"
    );
}

#[test]
fn interface_counters_from_sysfs() {
    let dir = std::env::temp_dir().join(format!("rl-metrics-sysfs-{}", std::process::id()));
    let stats = dir.join("eth0").join("statistics");
    std::fs::create_dir_all(&stats).unwrap();
    std::fs::write(stats.join("rx_packets"), "1234\n").unwrap();
    std::fs::write(stats.join("rx_dropped"), "5\n").unwrap();
    let mut s = snapshot();
    s.read_interface_counters(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        (s.interfaces[0].rx_packets, s.interfaces[0].rx_dropped),
        (Some(1234), Some(5))
    );
    assert_eq!(
        (s.interfaces[1].rx_packets, s.interfaces[1].rx_dropped),
        (None, None)
    );
}

#[tokio::test]
async fn bind_failure_names_the_address() {
    let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = taken.local_addr().unwrap();
    let err = bind(addr).await.unwrap_err().to_string();
    assert!(err.contains(&addr.to_string()), "{err}");
    assert!(err.contains("in use"), "{err}");
}

/// Under `backend = "redis"` the store's gauges and counters (`ratelimit_cluster_store_*`);
/// none under gossip.
#[test]
fn the_redis_store_is_up_counted_and_timed() {
    assert!(!snapshot()
        .encode()
        .unwrap()
        .contains("ratelimit_cluster_store_"));
    let mut snap = snapshot();
    if let Some(c) = snap.cluster.as_mut() {
        c.store = Some(crate::cluster::status::StoreStatus {
            addresses: vec!["redis://192.0.2.9:6379".into()],
            mode: "standalone",
            state: "down",
            rtt_ms: Some(1.5),
            round_trips: 120,
            errors: 4,
            ..Default::default()
        });
    }
    let text = snap.encode().unwrap();
    for line in [
        "ratelimit_cluster_store_up 0",
        "ratelimit_cluster_store_round_trips_total 120",
        "ratelimit_cluster_store_errors_total 4",
        "ratelimit_cluster_store_rtt_seconds 0.0015",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
}
