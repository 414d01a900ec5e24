//! What a round shows of its peers (`peers`, the metrics) and logs of them, and its own
//! counters.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::SocketAddr,
    time::Instant,
};

use chitchat::ChitchatId;

use crate::cluster::{
    partition::{Partition, Share},
    remote::RemoteTracker,
    status::{Counters, HeaviestKeys, LateRound, PeerStatus, Shared, LATE_ROUNDS_SHOWN},
    timing::Timing,
};

pub(super) fn peer_statuses(
    remote: &RemoteTracker<ChitchatId>,
    now: u64,
    unix_ms: u64,
    stored: &HashMap<ChitchatId, usize>,
) -> Vec<PeerStatus> {
    let mut peers: BTreeMap<(String, u64, SocketAddr), PeerStatus> = BTreeMap::new();
    for (id, info) in remote.info(now) {
        let state = if !info.live {
            "dead"
        } else if !info.verified {
            "unverified"
        } else if !info.heard {
            "silent"
        } else if !info.counted {
            "joining"
        } else {
            "alive"
        };
        peers.insert(
            (
                id.node_id.to_string(),
                id.generation_id,
                id.gossip_advertise_addr,
            ),
            PeerStatus {
                node_id: id.node_id.to_string(),
                generation: id.generation_id,
                addr: id.gossip_advertise_addr,
                state,
                counted: info.counted,
                last_heard_ms: Some(info.silent_ns / 1_000_000),
                lag_ms: info.published_unix_ms.map(|p| {
                    i64::try_from(unix_ms).unwrap_or(i64::MAX)
                        - i64::try_from(p).unwrap_or(i64::MAX)
                }),
                keys: info.keys,
                stored_keys: stored.get(id).copied().unwrap_or(0),
                charged_pkts: info.charged_pkts,
                charged_bytes: info.charged_bytes,
                clamped: 0,
            },
        );
    }
    peers.into_values().collect()
}

/// Logs peers that started or stopped being counted.
pub(super) fn log_membership(peers: &[PeerStatus], was: &mut HashSet<ChitchatId>) {
    let mut now_counted = HashSet::new();
    for p in peers {
        let id = ChitchatId::new(p.node_id.as_str(), p.generation, p.addr);
        if p.counted {
            if !was.contains(&id) {
                tracing::info!(peer = %p.node_id, generation = p.generation, addr = %p.addr, "cluster peer counted");
            }
            now_counted.insert(id);
        } else if was.contains(&id) {
            tracing::warn!(peer = %p.node_id, generation = p.generation, addr = %p.addr, state = p.state, "cluster peer no longer counted: enforcing without its consumption");
        }
    }
    for gone in was.difference(&now_counted) {
        if !peers
            .iter()
            .any(|p| p.node_id == *gone.node_id && p.generation == gone.generation_id)
        {
            tracing::warn!(peer = %gone.node_id, generation = gone.generation_id, "cluster peer left");
        }
    }
    *was = now_counted;
}

/// Shows this round in the status: the peers, the heaviest keys and the partition's share.
pub(super) fn show(
    shared: &Shared,
    peers: Vec<PeerStatus>,
    heaviest: HeaviestKeys,
    self_id: &ChitchatId,
    share: Share,
    partition: &Partition,
) {
    let mut view = shared.view();
    view.peers = peers;
    view.keys = heaviest.into_status(&self_id.node_id, self_id.generation_id);
    view.hosts_heard = share.heard;
    view.hosts_known = share.known;
    view.budget_share = partition.budget_share(share);
}

/// Counts a round whose shares landed `late` after it was due, if that makes it late (see
/// [`LateRound`]), and shows it in the status with `lapsed_ns`, how long the shares it renewed
/// had lapsed.
pub(super) fn count_late(
    shared: &Shared,
    late: std::time::Duration,
    timing: &Timing,
    lapsed_ns: u64,
) {
    let late_ns = u64::try_from(late.as_nanos()).unwrap_or(u64::MAX);
    if late_ns <= timing.late_after_ns() && lapsed_ns == 0 {
        return;
    }
    Counters::add(&shared.counters.rounds_late, 1);
    let mut view = shared.view();
    if view.late_rounds.len() >= LATE_ROUNDS_SHOWN {
        view.late_rounds.remove(0);
    }
    view.late_rounds.push(LateRound {
        at_unix_ms: super::super::unix_ms(),
        late_ms: late_ns / 1_000_000,
        lapsed_ms: lapsed_ns.div_ceil(1_000_000),
    });
}

/// Counts a sync that began at `began`, and the largest lag of the counted peers.
pub(super) fn count_sync(c: &Counters, peers: &[PeerStatus], began: Instant) {
    let lag = peers
        .iter()
        .filter(|p| p.counted)
        .filter_map(|p| p.lag_ms)
        .max()
        .unwrap_or(0);
    c.sync_lag_ms.store(
        u64::try_from(lag).unwrap_or(0),
        std::sync::atomic::Ordering::Relaxed,
    );
    Counters::add(&c.syncs, 1);
    c.last_sync_us.store(
        u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX),
        std::sync::atomic::Ordering::Relaxed,
    );
}
