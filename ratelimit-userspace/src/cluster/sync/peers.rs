//! The other members as chitchat holds them: where each stands, their states trimmed to
//! `max_keys`, and the views of them a round reads.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
};

use chitchat::ChitchatId;

use super::MAX_PEERS;
use crate::{
    cluster::{
        publish::{Count, KeyName, KEY_PREFIX, SYNC_KEY},
        remote::{self, PeerView, RemoteTracker},
        status::Shared,
        wire,
    },
    maps::bucket::monotonic_ns,
};

/// Where a member stands in one sync.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Live, its address sent an authentic datagram lately, and it is the newest incarnation
    /// with a sync key at that address: may be counted (the first [`MAX_PEERS`] of them).
    Candidate,
    /// Live in gossip, but no authentic datagram sealed by this identity came from its address
    /// lately (an id only named in others' digests or deltas, at any address, even a real
    /// member's): never counted.
    Unverified,
    /// Live and authenticated, but no sync key yet (joining, or an id only named in a digest at
    /// a real peer's address): shown, takes no place under [`MAX_PEERS`], charges nothing.
    Pending,
    /// Live, authenticated, the newest with a sync key at its address, but its heartbeat has
    /// not advanced for the peer timeout (stopped, or cut off while chitchat's failure detector
    /// still deems it alive): shown `silent`, takes no place under [`MAX_PEERS`], charges
    /// nothing.
    Silent,
    /// A newer incarnation at the same address took over: shown dead, never counted.
    Superseded,
    /// Dead according to the failure detector.
    Dead,
}

/// A member as `standings` sees it.
#[derive(Clone, Copy, Debug)]
pub struct Member<'a> {
    /// Its identity.
    pub id: &'a ChitchatId,
    /// Alive according to the failure detector.
    pub live: bool,
    /// It published a sync key.
    pub has_sync: bool,
    /// An authentic datagram sealed by this identity came from its advertised address lately.
    pub authenticated: bool,
    /// Its heartbeat advanced within the peer timeout (see [`RemoteTracker::heard`]).
    pub heard: bool,
}

/// The standing of every member: only live, authenticated, heard members that are the newest
/// incarnation with a sync key at their address are candidates, so ids merely named in gossip
/// create no charging peer and neither they, silent members nor dead incarnations take a place
/// under [`MAX_PEERS`].
#[must_use]
pub fn standings(members: &[Member<'_>]) -> Vec<Standing> {
    let mut newest: HashMap<SocketAddr, u64> = HashMap::new();
    for m in members {
        if m.live && m.authenticated && m.has_sync {
            let g = newest.entry(m.id.gossip_advertise_addr).or_insert(0);
            *g = (*g).max(m.id.generation_id);
        }
    }
    members
        .iter()
        .map(|m| {
            if !m.live {
                Standing::Dead
            } else if !m.authenticated {
                Standing::Unverified
            } else if newest
                .get(&m.id.gossip_advertise_addr)
                .is_some_and(|g| *g > m.id.generation_id)
            {
                Standing::Superseded
            } else if !m.has_sync {
                Standing::Pending
            } else if !m.heard {
                Standing::Silent
            } else {
                Standing::Candidate
            }
        })
        .collect()
}

/// Keeps at most `max_keys` consumption keys and the sync key in every other member's node
/// state, so a peer publishing more keys than `max_keys` holds no more of this agent's memory
/// than that after each round (whatever arrives within one round, at most). Kept: the sync
/// key, then the consumption keys [`read_peers`] reads (the first in key order), then
/// tombstones; anything else goes. Returns the number of keys removed.
///
/// chitchat offers no hook where it applies deltas, so the state is rewritten through
/// `reset_node_state_if_update`, which requires `(last_gc_version, max_version)` to grow: the
/// last GC version is raised to the max version (as if the removed keys had been deleted and
/// collected), so the peer's later updates (newer versions) still apply here, and members
/// behind us on that peer get a full reset of the trimmed state from us rather than a delta
/// missing deletions. Only when that pair cannot grow (a state received in a reset whose GC
/// version already equals its max version: only a peer that published too many keys sends
/// that) is the max version raised by one, which skips at most that peer's next version.
pub(super) fn trim_peer_states(
    c: &mut chitchat::Chitchat,
    self_id: &ChitchatId,
    max_keys: usize,
) -> u64 {
    let mut rewrites = Vec::new();
    for (id, state) in c.node_states() {
        if id == self_id || state.key_values_including_deleted().count() <= max_keys + 1 {
            continue;
        }
        let mut kept: Vec<(String, chitchat::VersionedValue)> = Vec::with_capacity(max_keys + 1);
        if let Some(v) = state.get_versioned(SYNC_KEY) {
            kept.push((SYNC_KEY.to_string(), v.clone()));
        }
        let counters = || {
            state
                .key_values_including_deleted()
                .filter(|(k, _)| k.starts_with(KEY_PREFIX))
        };
        kept.extend(
            counters()
                .filter(|(_, v)| !v.is_deleted())
                .chain(counters().filter(|(_, v)| v.is_deleted()))
                .take(max_keys)
                .map(|(k, v)| (k.to_string(), v.clone())),
        );
        let removed = state.key_values_including_deleted().count() - kept.len();
        let (gc, max) = (state.last_gc_version(), state.max_version());
        let to = if gc < max { max } else { max + 1 };
        rewrites.push((id.clone(), kept, to, removed));
    }
    let mut removed_total = 0u64;
    for (id, kept, to, removed) in rewrites {
        c.reset_node_state_if_update(&id, kept.into_iter(), to, to);
        removed_total += removed as u64;
    }
    if removed_total > 0 {
        tracing::debug!(
            removed = removed_total,
            max_keys,
            "cluster sync: peers' keys beyond max_keys removed from the gossip state"
        );
    }
    removed_total
}

/// The other members' views, the number of keys left out, and the number of keys stored for
/// each member (tombstones included): the first [`MAX_PEERS`] candidates (see [`standings`])
/// with at most `max_keys` keys each, then at most as many other members, without keys, to
/// show. `authenticated` says whether an authentic datagram sealed by a member's identity came
/// from its advertised address lately (ten peer timeouts); `direct`, when the last one did, if
/// within the peer timeout (alive and heard, whatever chitchat's failure detector and heartbeat
/// say);
/// `heard`, whether a member with this heartbeat is still heard.
pub(super) fn read_peers(
    c: &chitchat::Chitchat,
    self_id: &ChitchatId,
    max_keys: usize,
    authenticated: impl Fn(&ChitchatId) -> bool,
    direct: impl Fn(&ChitchatId) -> Option<u64>,
    heard: impl Fn(&ChitchatId, u64) -> bool,
) -> (Vec<PeerView<ChitchatId>>, u64, HashMap<ChitchatId, usize>) {
    let live: HashSet<&ChitchatId> = c.live_nodes().collect();
    let states: Vec<(&ChitchatId, &chitchat::NodeState)> = c
        .node_states()
        .iter()
        // Our own earlier incarnations (before a gossip restart) come back through peers'
        // gossip: they are not peers.
        .filter(|(id, _)| {
            id.node_id != self_id.node_id
                || id.gossip_advertise_addr != self_id.gossip_advertise_addr
        })
        .collect();
    let members: Vec<Member<'_>> = states
        .iter()
        .map(|(id, state)| Member {
            id,
            // Alive and heard if chitchat says so, or if it sealed an authentic datagram from its
            // address within the peer timeout (a heartbeat pushed ahead in chitchat by another
            // member makes chitchat's failure detector stop hearing it).
            live: live.contains(id) || direct(id).is_some(),
            has_sync: state.get(SYNC_KEY).is_some(),
            authenticated: authenticated(id),
            heard: direct(id).is_some() || heard(id, u64::from(state.heartbeat())),
        })
        .collect();
    let standing = standings(&members);
    let mut views = Vec::new();
    let (mut candidates, mut others) = (0usize, 0usize);
    let mut dropped = 0u64;
    let stored = states
        .iter()
        .map(|(id, state)| ((*id).clone(), state.key_values_including_deleted().count()))
        .collect();
    for ((id, state), standing) in states.iter().zip(standing) {
        let counting = standing == Standing::Candidate && candidates < MAX_PEERS;
        let mut keys = Vec::new();
        if standing == Standing::Candidate {
            let mut extra = 0u64;
            for (k, v) in state.iter_prefix(KEY_PREFIX) {
                if !counting || keys.len() >= max_keys {
                    extra += 1;
                    continue;
                }
                if let (Some(name), Some(count)) = (KeyName::parse(k), Count::parse(&v.value)) {
                    keys.push((name, count));
                }
            }
            dropped += extra;
            if !counting {
                continue;
            }
            candidates += 1;
        } else {
            if others >= MAX_PEERS {
                continue;
            }
            others += 1;
        }
        // A silent member's sync key is not read: it cannot be counted this round.
        let sync_value = state.get(SYNC_KEY).filter(|_| standing != Standing::Silent);
        let sync = sync_value.and_then(remote::parse_sync);
        let keys_digest = sync_value.and_then(remote::parse_keys_digest);
        views.push(PeerView {
            id: (*id).clone(),
            live: matches!(
                standing,
                Standing::Candidate | Standing::Pending | Standing::Unverified | Standing::Silent
            ),
            verified: matches!(
                standing,
                Standing::Candidate | Standing::Pending | Standing::Silent
            ),
            heartbeat: u64::from(state.heartbeat()),
            heard_at: direct(id),
            sync,
            keys_digest,
            keys,
        });
    }
    (views, dropped, stored)
}

/// A member's identity as datagrams show it: its advertised address and its sender tag
/// ([`wire::sender_tag`]).
type Sender = (SocketAddr, u64);

/// The identities that sealed an authentic datagram from their advertised address within ten
/// peer timeouts, and those heard so within the peer timeout, with when (see [`read_peers`]).
pub(super) fn heard_lately(
    shared: &Shared,
    timeout_ns: u64,
) -> (HashSet<Sender>, HashMap<Sender, u64>) {
    let since = monotonic_ns().saturating_sub(timeout_ns.saturating_mul(10));
    let trusted = shared
        .authenticated
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .all_since(since);
    // Identities heard directly within the peer timeout: heard whatever their heartbeat
    // in chitchat (see [`PeerView::direct`]).
    let direct = shared
        .authenticated
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .last_since(monotonic_ns().saturating_sub(timeout_ns));
    (trusted, direct)
}

/// Trims the peers' states ([`trim_peer_states`]) and reads them ([`read_peers`]): their views,
/// the keys left out or removed, and the keys stored for each.
pub(super) fn trim_and_read(
    c: &mut chitchat::Chitchat,
    self_id: &ChitchatId,
    max_keys: usize,
    trusted: &HashSet<Sender>,
    direct: &HashMap<Sender, u64>,
    remote: &RemoteTracker<ChitchatId>,
) -> (Vec<PeerView<ChitchatId>>, u64, HashMap<ChitchatId, usize>) {
    let trimmed = trim_peer_states(c, self_id, max_keys);
    let now = monotonic_ns();
    let (views, dropped, stored) = read_peers(
        c,
        self_id,
        max_keys,
        |id| {
            trusted.contains(&(
                id.gossip_advertise_addr,
                wire::sender_tag(&id.node_id, id.generation_id),
            ))
        },
        |id| {
            direct
                .get(&(
                    id.gossip_advertise_addr,
                    wire::sender_tag(&id.node_id, id.generation_id),
                ))
                .copied()
        },
        |id, heartbeat| remote.heard(id, heartbeat, now),
    );
    (views, dropped + trimmed, stored)
}
