//! What peers report and this host divides the budget by: their *demand* per key.
//!
//! For every peer *incarnation* (chitchat's node id includes a generation, new at every start)
//! and every key it publishes, this remembers the `(epoch, demand)` last read, and turns what the
//! cumulative demand counter (packets that reached the peer's bucket, admitted or dropped)
//! gained between two of the peer's syncs into a rate: packets per second over the time between
//! those syncs, by the peer's own clock (its sync key carries it). Because the counters are
//! cumulative, a lost update is caught up by the next one (over the longer span), a repeated or
//! older one gains nothing, and a restarted peer is a new incarnation counting from zero,
//! tracked apart from the old one (which stops being heard and is forgotten).
//!
//! A peer is *counted* only while it is alive and heard within the timeout, and once its sync key
//! has arrived (its keys are then complete as of that sync). When it starts being counted (first
//! seen, back from a partition or a silence), what it reports is taken as the baseline; its
//! demand is known from its next sync on. A peer not counted has no demand here (fail open).
//!
//! # Trust
//! Demand is not bounded: a peer with the key may claim any. What a claim can do is bounded by
//! the share ([`super::sync`]): it can take this host's share of a key down to nothing while it
//! claims (the bucket then refills no faster than it did), never into debt, and the claim ends
//! with it. A key a peer publishes with a known demand, 0 included, is one it *holds*
//! ([`Round::holders`]): the budget of the key is divided between the hosts holding it, so a peer
//! publishing a key without demand takes its own even part of what nobody uses (one part per
//! counted identity), never more.

mod limits;
mod round;
#[cfg(test)]
mod tests;
mod view;
mod window;

use std::{collections::HashMap, hash::Hash};

pub use self::{
    limits::{ClusterLimits, Limits},
    round::Round,
    view::{parse_keys_digest, parse_sync, PeerView},
    window::{DemandWindow, DEMAND_HISTORY, DEMAND_PACKETS, DEMAND_ROUNDS},
};
use super::publish::{keys_digest, Count, KeyName};

#[derive(Clone, Debug)]
struct Applied {
    count: Count,
    /// Its demand by the peer's sync times (ms).
    window: DemandWindow,
}

#[derive(Debug)]
struct PeerTrack {
    heartbeat: u64,
    last_heard_ns: u64,
    counted: bool,
    /// Keys with an epoch below this existed before we started counting the peer.
    baseline_epoch: u64,
    /// Heard again after a silence: the first fresh sync sequence read; the baseline waits for a
    /// newer one (see [`RemoteTracker::round`]).
    rejoin_seq: Option<u64>,
    sync: Option<(u64, u64, u64)>,
    keys: HashMap<KeyName, Applied>,
    /// Per key whose demand is known (read twice in one epoch, or new since counting began),
    /// its demand (packets/s) between its last two syncs read here, 0 included.
    rates: HashMap<KeyName, f64>,
    /// When (here) its sync key last moved on.
    synced_ns: u64,
    /// Whether the keys read at its sync of this sequence make the digest it names (see
    /// [`Round::holders`]).
    attested: Option<(u64, bool)>,
    published: usize,
    charged_pkts: u64,
    charged_bytes: u64,
    live: bool,
    verified: bool,
}

/// A peer's state for `peers`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// Heard within the timeout (and alive).
    pub heard: bool,
    /// Counted (its demand takes a share of the budget here).
    pub counted: bool,
    /// Alive according to the failure detector.
    pub live: bool,
    /// See [`PeerView::verified`].
    pub verified: bool,
    /// ns since its heartbeat last advanced.
    pub silent_ns: u64,
    /// Its last sync key's Unix ms.
    pub published_unix_ms: Option<u64>,
    /// Keys read from it.
    pub keys: usize,
    /// Refill withheld here for its share so far, in packets (see [`RemoteTracker::credit`]).
    pub charged_pkts: u64,
    /// Refill withheld here for its share so far, in bytes.
    pub charged_bytes: u64,
}

impl PeerTrack {
    /// A peer first seen at `now`, as `view` shows it.
    fn new<P>(view: &PeerView<P>, now: u64) -> Self {
        Self {
            heartbeat: view.heartbeat,
            last_heard_ns: now,
            counted: false,
            baseline_epoch: 0,
            rejoin_seq: None,
            sync: None,
            keys: HashMap::new(),
            rates: HashMap::new(),
            synced_ns: now,
            attested: None,
            published: 0,
            charged_pkts: 0,
            charged_bytes: 0,
            live: view.live,
            verified: view.verified,
        }
    }
}

/// Every peer incarnation seen, with its demand.
#[derive(Debug)]
pub struct RemoteTracker<P> {
    timeout_ns: u64,
    stale_ns: u64,
    /// The span a bursty key's demand is read over (ms, the peers' clocks' unit).
    span_ms: u64,
    /// This host's Unix time (ms) for the round, once set ([`RemoteTracker::set_clock`]).
    unix_ms: Option<u64>,
    peers: HashMap<P, PeerTrack>,
}

/// How far a key's epoch may be ahead of the next epoch its peer's sync key names: keys that
/// entered the peer's published set after that sync key (a round's worth, read before the next
/// sync key arrives; `max_keys` is at most 100,000).
pub const EPOCHS_AHEAD: u64 = 1 << 20;

impl<P: Clone + Eq + Hash + std::fmt::Debug> RemoteTracker<P> {
    /// A tracker that stops counting a peer not heard for `timeout_ns`, and stops counting the
    /// demand of a counted peer whose sync key did not move on for `stale_ns` (a stopped or
    /// restarted agent, a peer cut off: until the timeout it is still counted, but what it last
    /// reported no longer takes a share). A bursty key's demand is read over its last `span_ns`
    /// ([`DemandWindow::rate`]).
    #[must_use]
    pub fn new(timeout_ns: u64, stale_ns: u64, span_ns: u64) -> Self {
        Self {
            timeout_ns,
            stale_ns,
            span_ms: span_ns / 1_000_000,
            unix_ms: None,
            peers: HashMap::new(),
        }
    }

    /// This host's Unix time (ms) as of the next round: a sync key dated more than
    /// [`MAX_SKEW_MS`](super::wire::MAX_SKEW_MS) after it is refused (without a clock set, the
    /// dates are not checked).
    pub fn set_clock(&mut self, unix_ms: u64) {
        self.unix_ms = Some(unix_ms);
    }

    /// Folds in the peers as read at `now` (`CLOCK_MONOTONIC` ns); `limits` gives the local
    /// cluster-scoped limits by rule name and index (keys of other rules and limits have no
    /// demand here). Peers no longer in `views` are forgotten.
    pub fn round(&mut self, now: u64, views: &[PeerView<P>], limits: &ClusterLimits) -> Round<P> {
        let mut round = Round::default();
        self.peers.retain(|id, _| views.iter().any(|v| v.id == *id));
        for view in views {
            let track = self
                .peers
                .entry(view.id.clone())
                .or_insert_with(|| PeerTrack::new(view, now));
            if view.heartbeat != track.heartbeat {
                track.heartbeat = view.heartbeat;
                track.last_heard_ns = now;
            }
            if let Some(t) = view.heard_at {
                track.last_heard_ns = track.last_heard_ns.max(t.min(now));
            }
            track.live = view.live;
            track.verified = view.verified;
            track.published = view.keys.len();
            let heard = view.live
                && view.verified
                && now.saturating_sub(track.last_heard_ns) <= self.timeout_ns;
            let Some(sync) = view.sync.filter(|_| heard) else {
                track.counted = false;
                track.rejoin_seq = None;
                track.rates.clear();
                track.attested = None;
                continue;
            };
            // Every reading is checked before it counts: a peer with the key may write anything
            // (under its own id, or under another member's through chitchat's relaying), and a
            // reading taken as the newest would make every real one after it look old.
            // A sync key dated ahead of our clock (by more than datagrams may be) is refused:
            // the peer is not counted this round (fail open) and what it sent before stands.
            if self
                .unix_ms
                .is_some_and(|ms| sync.1 > ms.saturating_add(super::wire::MAX_SKEW_MS))
            {
                round.refused += 1;
                continue;
            }
            // An honest peer's sync sequence never goes back (chitchat only ever replaces a key
            // with a newer version of it): the one read before was not the peer's (or the peer
            // misbehaves). Start again from this one, as a new baseline.
            if track.sync.is_some_and(|last| sync.0 < last.0) {
                round.refused += 1;
                track.sync = None;
                track.counted = false;
                track.rejoin_seq = None;
                track.rates.clear();
                track.attested = None;
                track.keys.clear();
            }
            if waits_to_rejoin(track, sync) {
                continue;
            }
            let previous = track.sync.replace(sync);
            if previous.is_none_or(|p| sync.0 > p.0) {
                track.synced_ns = now;
            }
            round.counted_peers += 1;
            if !track.counted {
                // (Re)joining: everything reported so far is the baseline; its demand is known
                // from its next sync on.
                track.counted = true;
                track.baseline_epoch = sync.2;
                track.rates.clear();
                track.attested = None;
                track.keys = view
                    .keys
                    .iter()
                    .map(|(k, c)| {
                        let mut window = DemandWindow::default();
                        window.push(sync.1, c.demand);
                        (k.clone(), Applied { count: *c, window })
                    })
                    .collect();
                continue;
            }
            round.keys_synced += view.keys.len() as u64;
            // A new sync of the peer: each key's reading joins its window, and its demand is
            // the gain over the window by the peer's clock (see [`DemandWindow`]). The same
            // sync as last round (gossip has not brought a newer one): the demand stands.
            if previous.is_none_or(|p| sync.0 > p.0) {
                fold_keys(track, view, sync, previous, self.span_ms, &mut round);
            }
            if now.saturating_sub(track.synced_ns) > self.stale_ns {
                continue;
            }
            hold(track, view, limits, &mut round);
        }
        round
    }

    /// Adds `pkts` packets and `bytes` bytes of refill withheld for `id`'s share to its totals.
    pub fn credit(&mut self, id: &P, pkts: u64, bytes: u64) {
        if let Some(t) = self.peers.get_mut(id) {
            t.charged_pkts = t.charged_pkts.saturating_add(pkts);
            t.charged_bytes = t.charged_bytes.saturating_add(bytes);
        }
    }

    /// Whether `id`, whose heartbeat reads `heartbeat` at `now`, is still heard: its heartbeat
    /// advanced since the last round, or within the timeout. A peer not tracked yet is.
    #[must_use]
    pub fn heard(&self, id: &P, heartbeat: u64, now: u64) -> bool {
        self.peers.get(id).is_none_or(|t| {
            t.heartbeat != heartbeat || now.saturating_sub(t.last_heard_ns) <= self.timeout_ns
        })
    }

    /// The state of every peer, for display.
    pub fn info(&self, now: u64) -> impl Iterator<Item = (&P, PeerInfo)> {
        self.peers.iter().map(move |(id, t)| {
            let silent_ns = now.saturating_sub(t.last_heard_ns);
            (
                id,
                PeerInfo {
                    heard: t.live && t.verified && silent_ns <= self.timeout_ns,
                    counted: t.counted,
                    live: t.live,
                    verified: t.verified,
                    silent_ns,
                    published_unix_ms: t.sync.map(|s| s.1),
                    keys: t.published,
                    charged_pkts: t.charged_pkts,
                    charged_bytes: t.charged_bytes,
                },
            )
        })
    }
}

/// Whether a peer not counted, heard again after a silence, waits for a newer sync key before
/// its baseline is taken (see [`RemoteTracker::round`]).
fn waits_to_rejoin(track: &mut PeerTrack, sync: (u64, u64, u64)) -> bool {
    if !track.counted {
        if let Some(last) = track.sync {
            // Heard again after a silence. Its heartbeat travels in digests, ahead of its
            // keys, so what is read first may still be its state from before the silence;
            // and the first newer sync key may be a snapshot taken before it could be
            // heard again. The baseline waits for a sync key newer than the first fresh
            // one: published after this host heard it again.
            if sync.0 <= last.0 {
                return true;
            }
            match track.rejoin_seq {
                Some(first) if sync.0 > first => track.rejoin_seq = None,
                Some(_) => return true,
                None => {
                    track.rejoin_seq = Some(sync.0);
                    return true;
                }
            }
        }
    }
    false
}

/// Folds a new sync of a counted peer into its keys: each key's reading joins its window, and
/// its demand is the rate over the window.
fn fold_keys<P>(
    track: &mut PeerTrack,
    view: &PeerView<P>,
    sync: (u64, u64, u64),
    previous: Option<(u64, u64, u64)>,
    span_ms: u64,
    round: &mut Round<P>,
) {
    let last_ms = previous.map_or(0, |p| p.1);
    let mut keys = HashMap::with_capacity(view.keys.len());
    let mut rates = HashMap::with_capacity(view.keys.len());
    for (name, count) in &view.keys {
        let prev = track.keys.remove(name);
        // A key of an epoch the peer cannot have given yet: refused, what was read
        // before stands.
        if count.epoch > sync.2.saturating_add(EPOCHS_AHEAD) {
            round.refused += 1;
            if let Some(a) = prev {
                keys.insert(name.clone(), a);
            }
            continue;
        }
        let mut applied = match prev {
            Some(mut a) if a.count.epoch == count.epoch => {
                // A counter that went back in the same epoch: what was read before
                // was not the peer's count (chitchat never brings an older value).
                // Its window starts again from this reading.
                if count.demand < a.count.demand {
                    round.refused += 1;
                }
                a.count = *count;
                a
            }
            // An older epoch than the one read before: likewise, a new baseline
            // (no demand until its next reading), never a mark later readings of
            // the real epoch stay under.
            Some(a) if a.count.epoch > count.epoch => {
                round.refused += 1;
                Applied {
                    count: *count,
                    window: DemandWindow::default(),
                }
            }
            // A key (or a new epoch of it) that began while we counted the peer: all
            // of it is demand since its last sync.
            _ if count.epoch >= track.baseline_epoch => {
                let mut window = DemandWindow::default();
                window.push(last_ms, 0);
                Applied {
                    count: *count,
                    window,
                }
            }
            // A key older than our counting that we had not seen: baseline.
            _ => Applied {
                count: *count,
                window: DemandWindow::default(),
            },
        };
        applied.window.push(sync.1, applied.count.demand);
        if applied.window.len() >= 2 {
            rates.insert(name.clone(), applied.window.rate(1000.0, span_ms));
        }
        keys.insert(name.clone(), applied);
    }
    track.keys = keys;
    track.rates = rates;
}

/// Counts the peer among the holders of each key it holds in `round`, and its demand.
fn hold<P: Clone>(
    track: &mut PeerTrack,
    view: &PeerView<P>,
    limits: &ClusterLimits,
    round: &mut Round<P>,
) {
    // Its idle keys are held only if what is read of it is what it published (its
    // sync key names the digest of its keys): otherwise it holds only the keys it has
    // demand for (fail open: an idle key's part goes back to the other holders).
    // Worked out once per sync of the peer (up to `max_keys` keys to hash): keys that
    // arrive without a newer sync key are weighed at its next one, a round later.
    let seq = track.sync.map_or(0, |s| s.0);
    let attested = match track.attested {
        Some((at, a)) if at == seq => a,
        _ => {
            let a = track.rates.values().any(|&r| r <= 0.0)
                && view
                    .keys_digest
                    .as_deref()
                    .is_some_and(|d| keys_digest(view.keys.iter().map(|(k, _)| k.to_key())) == d);
            track.attested = Some((seq, a));
            a
        }
    };
    for (name, &rate) in &track.rates {
        if limits.get(name).is_some() && (rate > 0.0 || attested) {
            *round.holders.entry(name.clone()).or_default() += 1;
            if rate > 0.0 {
                round
                    .demand
                    .entry(name.clone())
                    .or_default()
                    .push((view.id.clone(), rate));
            }
        }
    }
}
