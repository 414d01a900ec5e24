//! What authenticated peers report, past the seal and chitchat: `cluster::remote::RemoteTracker`
//! driven with fuzzed peer states, round after round (peers alive or not, heard or silent, sync
//! keys present or not, restarted as new incarnations, demand counters of any epoch and value,
//! keys appearing and vanishing), as a member with the key (compromised or buggy) could make
//! them. Besides "no panic, no overflow":
//! - a peer not heard (dead, or silent past the timeout), or not counted, has no demand;
//! - a peer's first counted round is its baseline and has no demand (fail open);
//! - every demand is a finite rate above zero (no NaN or infinity reaches a share);
//! - keys of rules, or of limits of a rule, that are not cluster-scoped here have no demand.
#![no_main]

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

use libfuzzer_sys::fuzz_target;
use ratelimit::cluster::{
    publish::{keys_digest, Count, KeyName},
    remote::{ClusterLimits, Limits, PeerView, RemoteTracker},
};

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;
/// 1000 pps, burst 500; 1 MB/s, burst 64 KiB.
const LIMITS: Limits = Limits {
    pkt_interval_ns: MS,
    pkt_tolerance_ns: 500 * MS,
    byte_interval_fp: (1000 << 16),
    byte_tolerance_ns: 65_536 * 1000,
};
const TIMEOUT_NS: u64 = 3 * S;
/// Three 100 ms sync intervals of report jitter.
const LAG_NS: u64 = 300 * MS;
/// A bursty key's demand read over six 100 ms sync intervals.
const SPAN_NS: u64 = 600 * MS;

fn key(k: u8) -> KeyName {
    KeyName {
        // Rule "other" is not a cluster rule here: never charged.
        rule: if k & 2 == 0 { "flood" } else { "other" }.into(),
        // Limit 1 of "flood" is not cluster-scoped here either: never charged.
        limit: (k >> 2) & 1,
        addr: IpAddr::from([198, 18, 0, 1 + (k & 1)]),
    }
}

/// Whether `k` is of the one cluster-scoped limit here: limit 0 of "flood".
fn is_cluster(k: &KeyName) -> bool {
    k.rule == "flood" && k.limit == 0
}

#[derive(Clone, Default)]
struct Peer {
    incarnation: u8,
    heartbeat: u64,
    live: bool,
    sync: Option<(u64, u64, u64)>,
    keys: BTreeMap<KeyName, Count>,
    /// Every cluster-rule key this incarnation ever published.
    ever: std::collections::BTreeSet<KeyName>,
    first_seen_ns: Option<u64>,
}

fuzz_target!(|data: &[u8]| {
    let limits = ClusterLimits::default().with("flood", 0, LIMITS);
    let mut tracker = RemoteTracker::<(u8, u8)>::new(TIMEOUT_NS, LAG_NS, SPAN_NS);
    let mut peers: [Peer; 3] = Default::default();
    let mut now = S;
    // Whether each incarnation was counted after the last round.
    let mut before: HashMap<(u8, u8), bool> = HashMap::new();
    for op in data.chunks_exact(8) {
        let p = usize::from(op[0] % 3);
        let peer = &mut peers[p];
        let flags = op[1];
        if flags & 8 != 0 {
            // Restarted: a new incarnation, counting from zero.
            *peer = Peer {
                incarnation: peer.incarnation.wrapping_add(1),
                ..Peer::default()
            };
        }
        peer.live = flags & 1 != 0;
        peer.heartbeat += u64::from(op[2] % 4);
        now += u64::from(op[7]) * 20 * MS;
        if flags & 2 != 0 {
            let seq = peer.sync.map_or(0, |s| s.0 + 1);
            // Its clock: ours, or (flag 64) stepped back.
            let ms = if flags & 64 != 0 { 0 } else { now / MS };
            peer.sync = Some((seq, ms, u64::from(op[4] % 4)));
        }
        let name = key(op[3]);
        if flags & 4 != 0 {
            peer.keys.remove(&name);
        } else {
            if is_cluster(&name) {
                peer.ever.insert(name.clone());
            }
            let value = u64::from(u16::from_be_bytes([op[5], op[6]]));
            // Scaled by the flags' high bits: small, large, and absurd counts.
            let value = value << ((flags >> 4) * 4);
            peer.keys.insert(
                name,
                Count {
                    epoch: u64::from(op[4] % 4),
                    pkts: value,
                    bytes: value.saturating_mul(1500),
                    demand: value,
                },
            );
        }

        let views: Vec<PeerView<(u8, u8)>> = peers
            .iter_mut()
            .enumerate()
            .map(|(i, peer)| {
                peer.first_seen_ns.get_or_insert(now);
                PeerView {
                    id: (u8::try_from(i).unwrap(), peer.incarnation),
                    live: peer.live,
                    verified: true,
                    heartbeat: peer.heartbeat,
                    // Heard through chitchat's heartbeat only, as the tracker's own tests do
                    // for peers not heard directly.
                    heard_at: None,
                    sync: peer.sync,
                    // What an honest peer's sync key names: the keys it publishes.
                    keys_digest: Some(keys_digest(peer.keys.iter().map(|(k, _)| k.to_key()))),
                    keys: peer.keys.iter().map(|(k, c)| (k.clone(), *c)).collect(),
                }
            })
            .collect();
        let round = tracker.round(now, &views, &limits);
        assert!(
            round.demand.keys().all(is_cluster),
            "a key of a rule or limit that is not cluster-scoped has demand: {:?}",
            round.demand
        );
        let infos: HashMap<(u8, u8), _> = tracker.info(now).map(|(id, i)| (*id, i)).collect();
        for (k, list) in &round.demand {
            assert!(round.peer_demand(k).is_finite(), "{round:?}");
            for (id, rate) in list {
                assert!(rate.is_finite() && *rate > 0.0, "{id:?}: {rate}");
                let info = &infos[id];
                assert!(
                    info.heard && info.counted,
                    "peer {id:?} has demand while not heard/counted"
                );
                assert!(
                    before.get(id).copied().unwrap_or(false),
                    "peer {id:?} has demand in its baseline round"
                );
            }
        }
        for (i, peer) in peers.iter().enumerate() {
            let id = (u8::try_from(i).unwrap(), peer.incarnation);
            let info = infos.get(&id).expect("every peer in the views is tracked");
            tracker.credit(&id, 1, 1);
            before.insert(id, info.counted);
        }
    }
});
