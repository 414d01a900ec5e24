//! What authenticated peers report, past the seal and chitchat: `cluster::remote::RemoteTracker`
//! driven with fuzzed peer states, round after round (peers alive or not, heard or silent, sync
//! keys present or not, restarted as new incarnations, consumption counters of any epoch and
//! value, keys appearing and vanishing), as a member with the key (compromised or buggy) could
//! make them. Besides "no panic, no overflow":
//! - a peer not heard (dead, or silent past the timeout) charges nothing;
//! - a peer's first counted round is its baseline and charges nothing (fail open);
//! - a round's charge from one peer is within the clamp: per key, what its bucket could have
//!   admitted (twice the tolerance, plus the time since it was first seen, plus a second);
//! - keys of rules, or of limits of a rule, that are not cluster-scoped here are never charged.
#![no_main]

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

use libfuzzer_sys::fuzz_target;
use ratelimit::cluster::{
    publish::{Count, KeyName},
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
    let mut tracker = RemoteTracker::<(u8, u8)>::new(TIMEOUT_NS, LAG_NS);
    let mut peers: [Peer; 3] = Default::default();
    let mut now = S;
    // (charged packets, charged bytes, counted) per incarnation after the last round.
    let mut before: HashMap<(u8, u8), (u64, u64, bool)> = HashMap::new();
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
        if flags & 2 != 0 {
            let seq = peer.sync.map_or(0, |s| s.0 + 1);
            peer.sync = Some((seq, 0, u64::from(op[4] % 4)));
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
                },
            );
        }
        now += u64::from(op[7]) * 20 * MS;

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
                    sync: peer.sync,
                    keys: peer.keys.iter().map(|(k, c)| (k.clone(), *c)).collect(),
                }
            })
            .collect();
        let round = tracker.round(now, &views, &limits);
        assert!(
            round.charges.keys().all(is_cluster),
            "a key of a rule or limit that is not cluster-scoped was charged: {:?}",
            round.charges
        );
        let infos: HashMap<(u8, u8), _> = tracker.info(now).map(|(id, i)| (*id, i)).collect();
        for (i, peer) in peers.iter().enumerate() {
            let id = (u8::try_from(i).unwrap(), peer.incarnation);
            let info = infos.get(&id).expect("every peer in the views is tracked");
            let (pkts0, bytes0, counted0) = before.get(&id).copied().unwrap_or((0, 0, false));
            let (dp, db) = (info.charged_pkts - pkts0, info.charged_bytes - bytes0);
            if !info.heard || !info.counted {
                assert_eq!(
                    (dp, db),
                    (0, 0),
                    "peer {id:?} charged while not heard/counted"
                );
            }
            if !counted0 {
                assert_eq!(
                    (dp, db),
                    (0, 0),
                    "peer {id:?} charged in its baseline round"
                );
            }
            // Bounded trust: over its whole life, per key it ever published, an incarnation
            // charged at most its allowance's depth plus the rate over the time since.
            let dt = now - peer.first_seen_ns.unwrap();
            let keys = peer.ever.len() as u64;
            let max_pkts = (LIMITS.pkt_allowance_ns(LAG_NS) + dt) / LIMITS.pkt_interval_ns;
            let max_bytes = (u128::from(LIMITS.byte_allowance_ns(LAG_NS) + dt) << 16)
                / u128::from(LIMITS.byte_interval_fp);
            assert!(
                info.charged_pkts <= keys * max_pkts,
                "peer {id:?} charged {} packets over {keys} keys in {dt} ns (bound {max_pkts} each)",
                info.charged_pkts
            );
            assert!(
                u128::from(info.charged_bytes) <= u128::from(keys) * max_bytes,
                "peer {id:?} charged {} bytes over {keys} keys in {dt} ns (bound {max_bytes} each)",
                info.charged_bytes
            );
            before.insert(id, (info.charged_pkts, info.charged_bytes, info.counted));
        }
    }
});
