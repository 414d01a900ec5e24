use std::time::Duration;

use super::{
    peers::{read_peers, trim_peer_states},
    *,
};
use crate::{
    cluster::remote::{ClusterLimits, Limits},
    maps::bucket::limit_bucket_key,
};

fn id(name: &str, generation: u64, port: u16) -> ChitchatId {
    ChitchatId::new(name.to_string(), generation, ([192, 0, 2, 1], port).into())
}

/// 100 ids that only appear in gossip (their addresses never sent an authentic datagram),
/// sorting before the real peer, dead incarnations of it, and a forged newer incarnation at
/// its address that published no sync key: none is a candidate, none pushes the real peer
/// out of [`MAX_PEERS`].
#[test]
fn only_authenticated_live_newest_incarnations_are_candidates() {
    let forged: Vec<ChitchatId> = (0..100)
        .map(|i| id(&format!("aaa{i:03}"), 1, 1000 + i))
        .collect();
    let dead: Vec<ChitchatId> = (0..100).map(|g| id("real", g, 7946)).collect();
    let real = id("real", 1000, 7946);
    let digest_only = id("real", 2000, 7946);
    let mut members: Vec<Member<'_>> = forged
        .iter()
        .map(|id| Member {
            id,
            live: true,
            has_sync: true,
            authenticated: false,
            heard: true,
        })
        .collect();
    members.extend(dead.iter().map(|id| Member {
        id,
        live: false,
        has_sync: true,
        authenticated: true,
        heard: true,
    }));
    members.push(Member {
        id: &real,
        live: true,
        has_sync: true,
        authenticated: true,
        heard: true,
    });
    members.push(Member {
        id: &digest_only,
        live: true,
        has_sync: false,
        authenticated: true,
        heard: true,
    });
    let s = standings(&members);
    assert!(s[..100].iter().all(|s| *s == Standing::Unverified));
    assert!(s[100..200].iter().all(|s| *s == Standing::Dead));
    assert_eq!(s[200], Standing::Candidate, "the real peer");
    // Named without a sync key: it cannot take over, nor take a place.
    assert_eq!(s[201], Standing::Pending);
    assert_eq!(
        s.iter().filter(|s| **s == Standing::Candidate).count(),
        1,
        "{s:?}"
    );
    // A restart: the new incarnation (with its sync key) supersedes the old one.
    let newer = id("real", 3000, 7946);
    members.push(Member {
        id: &newer,
        live: true,
        has_sync: true,
        authenticated: true,
        heard: true,
    });
    let s = standings(&members);
    assert_eq!(
        (s[200], s[202]),
        (Standing::Superseded, Standing::Candidate)
    );
    // The new incarnation stops: silent, no longer a candidate, and still the newest (the
    // old one does not come back).
    members[202].heard = false;
    let s = standings(&members);
    assert_eq!((s[200], s[202]), (Standing::Superseded, Standing::Silent));
    assert_eq!(s.iter().filter(|s| **s == Standing::Candidate).count(), 0);
}

/// Only the cluster-scoped limits of a rule are published and charged, each its own
/// bucket: a rule whose own limit is local and whose aggregate `[[rule.limit]]` is cluster
/// gives limit 1 alone; rules without a cluster-scoped limit, or not limiting, give nothing.
#[test]
fn cluster_rules_take_each_limit_by_its_own_scope() {
    let text = "[agent]\ninterfaces = [\"eth0\"]\n\
        [cluster]\nlisten = \"192.0.2.1:7946\"\nkey_file = \"/k\"\n\
        [[rule]]\nname = \"web\"\nsource = \"198.18.0.0/24\"\nrate = 200\n\
        [[rule.limit]]\nper = \"/28\"\nrate = 500\n\
        [[rule.limit]]\nper = \"rule\"\nrate = 1000\nburst = 500\nscope = \"cluster\"\n\
        [[rule]]\nname = \"own\"\nsource = \"10.0.0.0/8\"\nrate = 5\nscope = \"cluster\"\n\
        [[rule.limit]]\nper = \"rule\"\nrate = 50\n\
        [[rule]]\nname = \"local\"\nsource = \"10.1.0.0/16\"\nrate = 5\n\
        [[rule]]\nname = \"office\"\nsource = \"10.2.0.0/16\"\naction = \"allow\"\n";
    let config = crate::config::Config::parse(text, "test.toml").unwrap();
    let set = crate::compile::compile(&config.rules, &crate::compile::RuleIds::new()).unwrap();
    let rules = ClusterRules::of(&set);
    let mut names: Vec<&String> = rules.by_name.keys().collect();
    names.sort();
    assert_eq!(names, ["own", "web"]);
    let key = |rule: &str, limit: u8, addr: [u8; 4]| KeyName {
        rule: rule.into(),
        limit,
        addr: std::net::IpAddr::from(addr),
    };
    let limits = rules.limits();
    assert!(limits.get(&key("web", 0, [198, 18, 0, 7])).is_none());
    assert!(limits.get(&key("web", 1, [198, 18, 0, 0])).is_none());
    let agg = limits.get(&key("web", 2, [0, 0, 0, 0])).unwrap();
    assert_eq!(
        (agg.pkt_interval_ns, agg.pkt_tolerance_ns),
        (1_000_000, 500_000_000)
    );
    let own = limits.get(&key("own", 0, [10, 0, 0, 1])).unwrap();
    assert_eq!(own.pkt_interval_ns, 200_000_000);
    assert!(limits.get(&key("own", 1, [0, 0, 0, 0])).is_none());
    assert!(limits.get(&key("local", 0, [10, 1, 0, 1])).is_none());
    // The bucket the aggregate's key names is the one the XDP program keys limit 2 with.
    let (id, rule, l) = rules.limit_of(&key("web", 2, [0, 0, 0, 0])).unwrap();
    assert_eq!(l.pkt_interval_ns, 1_000_000);
    let b = ratelimit_common::Bucket {
        rule: u16::try_from(ratelimit_common::bucket_rule(id, 2)).unwrap(),
        family: ratelimit_common::family::V4,
        ..ratelimit_common::Bucket::default()
    };
    assert_eq!(rules.key_of(&b), Some(key("web", 2, [0, 0, 0, 0])));
    assert_eq!(
        limit_bucket_key(id, rule, 2, std::net::IpAddr::from([198, 18, 0, 9])),
        b.key()
    );
    // One key for both families (per = "rule"): an IPv6 source's is the same, so the
    // cluster publishes and shares one budget for the limit.
    assert_eq!(
        limit_bucket_key(id, rule, 2, "2001:db8::9".parse().unwrap()),
        b.key()
    );
    // A bucket of the rule's local limits is not the cluster's.
    let local = ratelimit_common::Bucket {
        rule: u16::try_from(ratelimit_common::bucket_rule(id, 0)).unwrap(),
        ..b
    };
    assert_eq!(rules.key_of(&local), None);
}

fn chitchat(self_id: &ChitchatId) -> chitchat::Chitchat {
    let (_tx, seeds) = tokio::sync::watch::channel(HashSet::new());
    let config = chitchat::ChitchatConfig {
        chitchat_id: self_id.clone(),
        cluster_id: "test".to_string(),
        gossip_interval: Duration::from_millis(100),
        listen_addr: self_id.gossip_advertise_addr,
        seed_nodes: Vec::new(),
        failure_detector_config: chitchat::FailureDetectorConfig::default(),
        marked_for_deletion_grace_period: Duration::from_secs(60),
        catchup_callback: None,
        extra_liveness_predicate: None,
        protocol_version: chitchat::ProtocolVersion::V1,
    };
    chitchat::Chitchat::with_chitchat_id_and_seeds(config, seeds, Vec::new())
}

fn value(value: &str, version: u64, deleted: bool) -> chitchat::VersionedValue {
    chitchat::VersionedValue {
        value: value.to_string(),
        version,
        status: if deleted {
            chitchat::DeletionStatus::Deleted(tokio::time::Instant::now())
        } else {
            chitchat::DeletionStatus::Set
        },
    }
}

/// A peer publishing 10 x `max_keys` keys (and as many tombstones) keeps `max_keys` of them
/// and its sync key here: the first in key order, which `read_peers` reads; the rest are
/// gone from chitchat's state and counted. Its later keys (newer versions) still arrive,
/// and are trimmed again; a peer within the cap is not touched.
#[test]
fn peers_keep_at_most_max_keys_stored() {
    let me = id("me", 1, 1);
    let flood = id("flood", 1, 2);
    let honest = id("honest", 1, 3);
    let max_keys = 10;
    let mut c = chitchat(&me);
    let mut kvs: Vec<(String, chitchat::VersionedValue)> = (0..10 * max_keys)
        .map(|i| {
            let k = format!("{KEY_PREFIX}r/10.0.{}.{}", i / 256, i % 256);
            (k, value("0:1:1", i as u64 + 1, false))
        })
        .collect();
    kvs.extend((0..10 * max_keys).map(|i| {
        let k = format!("{KEY_PREFIX}gone/{i}");
        (k, value("", (10 * max_keys + i) as u64 + 1, true))
    }));
    kvs.push((SYNC_KEY.to_string(), value("1:1:1", 201, false)));
    c.reset_node_state_if_update(&flood, kvs.into_iter(), 201, 0);
    let small: Vec<(String, chitchat::VersionedValue)> = vec![
        (format!("{KEY_PREFIX}r/10.9.0.1"), value("0:1:1", 1, false)),
        (SYNC_KEY.to_string(), value("1:1:1", 2, false)),
    ];
    c.reset_node_state_if_update(&honest, small.into_iter(), 2, 0);
    let stored = |c: &chitchat::Chitchat, id: &ChitchatId| {
        c.node_state(id)
            .unwrap()
            .key_values_including_deleted()
            .count()
    };
    assert_eq!(stored(&c, &flood), 20 * max_keys + 1);

    let removed = trim_peer_states(&mut c, &me, max_keys);
    assert_eq!(removed as usize, 19 * max_keys);
    assert_eq!(stored(&c, &flood), max_keys + 1);
    let state = c.node_state(&flood).unwrap();
    assert!(state.get(SYNC_KEY).is_some());
    let kept: Vec<&str> = state.iter_prefix(KEY_PREFIX).map(|(k, _)| k).collect();
    assert_eq!(kept.len(), max_keys);
    assert_eq!(kept[0], format!("{KEY_PREFIX}r/10.0.0.0"));
    assert_eq!((state.last_gc_version(), state.max_version()), (201, 201));
    assert_eq!(stored(&c, &honest), 2, "within the cap: untouched");
    assert_eq!(c.node_state(&honest).unwrap().max_version(), 2);
    assert_eq!(
        trim_peer_states(&mut c, &me, max_keys),
        0,
        "nothing left to trim"
    );

    // The peer publishes 10 x max_keys more: the state grows, and is trimmed again.
    let more: Vec<(String, chitchat::VersionedValue)> = c
        .node_state(&flood)
        .unwrap()
        .key_values_including_deleted()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .chain((0..10 * max_keys).map(|i| {
            (
                format!("{KEY_PREFIX}s/10.1.0.{i}"),
                value("0:1:1", 202 + i as u64, false),
            )
        }))
        .collect();
    let top = 201 + 10 * max_keys as u64;
    c.reset_node_state_if_update(&flood, more.into_iter(), top, 201);
    assert_eq!(stored(&c, &flood), 11 * max_keys + 1);
    assert_eq!(
        trim_peer_states(&mut c, &me, max_keys) as usize,
        10 * max_keys
    );
    assert_eq!(stored(&c, &flood), max_keys + 1);
    assert_eq!(c.node_state(&flood).unwrap().max_version(), top);

    // A state whose GC version already equals its max version (sent in a reset): the max
    // version moves on by one so the trim can apply.
    let reset: Vec<(String, chitchat::VersionedValue)> = (0..3 * max_keys)
        .map(|i| (format!("{KEY_PREFIX}t/{i}"), value("0:1:1", 1, false)))
        .collect();
    let evil = id("evil", 1, 4);
    c.reset_node_state_if_update(&evil, reset.into_iter(), 500, 500);
    assert_eq!(
        trim_peer_states(&mut c, &me, max_keys) as usize,
        2 * max_keys
    );
    assert_eq!(stored(&c, &evil), max_keys);
    assert_eq!(c.node_state(&evil).unwrap().max_version(), 501);
    // Our own state is never trimmed.
    for i in 0..3 * max_keys {
        c.self_node_state().set(format!("{KEY_PREFIX}x/{i}"), "v");
    }
    assert_eq!(trim_peer_states(&mut c, &me, max_keys), 0);
}

/// What gossip leaves in a host's chitchat state when a member with the key relays, under an
/// honest member's id, an idle key of a source that member never published (a delta with
/// the next version of that member: chitchat applies it, and keeps the key for as long as
/// the member lives, since the member never re-sets or deletes a key it does not have). Its
/// sync key names the digest of the keys it publishes, so the keys read here no longer make
/// it: its idle keys are not held (fail open), and the relayed key never holds the source
/// at a part of its rate here. Before, the source was held by two hosts here for ever
/// (`1 / 2` of its rate and burst) once the relaying member had stopped.
// One scenario kept whole: its steps share the two chitchat states and the closures driving
// them.
#[test]
fn a_key_relayed_under_a_members_id_is_told_apart_by_its_sync_key() {
    let me = id("me", 1, 1);
    let a = id("a", 1, 2);
    let mut own = chitchat(&a);
    let mut here = chitchat(&me);
    let key = |addr: [u8; 4]| KeyName {
        rule: "flood".into(),
        limit: 0,
        addr: std::net::IpAddr::from(addr),
    };
    let (its, victim) = (key([198, 18, 0, 7]), key([198, 18, 0, 100]));
    // `a` publishes one idle key, then its sync key, as the sync loop does.
    let publish = |own: &mut chitchat::Chitchat, seq: u64| {
        let node = own.self_node_state();
        node.set(its.to_key(), "1:0:0:0");
        let v = sync_value(
            seq,
            seq * 100,
            2,
            node.iter_prefix(KEY_PREFIX).map(|(k, _)| k),
        );
        node.set(SYNC_KEY, v);
    };
    // Gossip brings `a`'s state here (plus `extra`, relayed under its id).
    let deliver = |own: &mut chitchat::Chitchat,
                   here: &mut chitchat::Chitchat,
                   extra: Option<(String, u64)>| {
        let node = own.self_node_state();
        let mut kvs: Vec<(String, chitchat::VersionedValue)> = here
            .node_state(&a)
            .map(|s| {
                s.key_values_including_deleted()
                    .map(|(k, v)| (k.to_string(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let mut max = here
            .node_state(&a)
            .map_or(0, chitchat::NodeState::max_version);
        for (k, v) in node.key_values_including_deleted() {
            if v.version > max {
                kvs.retain(|(x, _)| x != k);
                kvs.push((k.to_string(), v.clone()));
            }
        }
        max = max.max(node.max_version());
        if let Some((k, version)) = extra {
            kvs.push((k, value("1:0:0:0", version, false)));
            max = max.max(version);
        }
        here.reset_node_state_if_update(&a, kvs.into_iter(), max, 0);
    };
    let limits = ClusterLimits::default().with(
        "flood",
        0,
        Limits {
            pkt_interval_ns: 1_000_000,
            pkt_tolerance_ns: 500_000_000,
            byte_interval_fp: 0,
            byte_tolerance_ns: 0,
        },
    );
    let mut tracker: RemoteTracker<ChitchatId> = RemoteTracker::new(
        3_000_000_000,
        300_000_000,
        Timing::new(100).demand_span_ns(),
    );
    let mut round = |here: &chitchat::Chitchat, seq: u64| {
        let (views, _, _) = read_peers(
            here,
            &me,
            1000,
            |_| true,
            |_| Some(seq * 100_000_000),
            |_, _| true,
        );
        tracker.round(seq * 100_000_000, &views, &limits)
    };
    for seq in 1..=3 {
        publish(&mut own, seq);
        deliver(&mut own, &mut here, None);
        round(&here, seq);
    }
    let r = round(&here, 4);
    assert_eq!(
        (r.hosts_holding(&its), r.hosts_holding(&victim)),
        (2, 1),
        "its own idle key is held by it: {r:?}"
    );
    // The relay: the victim's key at `a`'s next version.
    let next = here.node_state(&a).unwrap().max_version() + 1;
    deliver(&mut own, &mut here, Some((victim.to_key(), next)));
    // `a` carries on; the attacker is gone. Its sync key keeps moving here.
    let mut held = Vec::new();
    for seq in 5..=100 {
        publish(&mut own, seq);
        deliver(&mut own, &mut here, None);
        let r = round(&here, seq);
        held.push((r.hosts_holding(&its), r.hosts_holding(&victim)));
    }
    assert!(
        here.node_state(&a).unwrap().get(&victim.to_key()).is_some(),
        "chitchat keeps the relayed key"
    );
    assert_eq!(
        here.node_state(&a)
            .unwrap()
            .get(SYNC_KEY)
            .and_then(super::super::remote::parse_sync)
            .map(|s| s.0),
        Some(100),
        "its sync key moved on"
    );
    assert!(
        held[1..].iter().all(|&h| h == (1, 1)),
        "the relayed key is never held, nor (fail open) its idle keys: {held:?}"
    );
}
