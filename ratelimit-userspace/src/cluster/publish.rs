//! What this host tells its peers: for the heaviest keys of cluster-scoped limits (a rule's own
//! limit or any of its `[[rule.limit]]`s), the packets and bytes it admitted and the packets
//! that reached the bucket (its *demand*: admitted plus dropped) since it started publishing the
//! key, as cumulative counters. Peers divide the budget in proportion to the demand.
//!
//! The counters come from the buckets' own `passed_pkts`/`passed_bytes`/`dropped_pkts`, which
//! the XDP program keeps per bucket. A bucket can vanish (evicted) and come back with counters from zero; a
//! bucket may predate this agent (adopted pinned state). So each published key keeps its own
//! cumulative count in memory, advanced by what the bucket gained since the last look.
//!
//! Counters are per *epoch*: a key enters the published set with a new epoch number (increasing
//! within this incarnation) and counts from zero; if it leaves (displaced by heavier keys, or idle
//! with its bucket gone) and comes back, it does so in a new epoch. An idle key whose bucket is
//! still here stays: peers count this host among the holders of the key, between which its
//! budget is divided even while nobody sends (see [`super::charge`]). Peers remember `(epoch,
//! count)` per key, so a lost, repeated or reordered update can never charge anything twice.

mod heaviest;
mod keys;
#[cfg(test)]
mod tests;

use std::collections::HashMap;

pub use self::{
    heaviest::{candidate_rate, Heaviest},
    keys::{keys_digest, sync_value, Count, KeyName, KEY_PREFIX, SYNC_KEY},
};

/// One bucket as read from the map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketObs {
    /// `created_ns` of the bucket (identifies this life of it).
    pub created_ns: u64,
    /// `passed_pkts` (a 32-bit counter, wrapping).
    pub passed_pkts: u64,
    /// `passed_bytes`.
    pub passed_bytes: u64,
    /// `dropped_pkts` (a 32-bit counter, wrapping).
    pub dropped_pkts: u64,
}

impl BucketObs {
    /// Packets that reached the bucket, admitted or dropped (modulo 2^32, as its counters).
    #[must_use]
    pub fn demand(&self) -> u64 {
        self.passed_pkts.wrapping_add(self.dropped_pkts) & 0xffff_ffff
    }
}

#[derive(Clone, Debug)]
struct Published {
    count: Count,
    /// The bucket life last seen (0: gone) and its counters then.
    created_ns: u64,
    last_pkts: u64,
    last_bytes: u64,
    last_demand: u64,
    last_ns: u64,
    /// Packets reaching the bucket per second, smoothed.
    rate: f64,
    /// Last time the count moved.
    active_ns: u64,
    dirty: bool,
}

/// Keys whose count did not move for this long, and whose bucket is gone, leave the published
/// set.
pub const IDLE_NS: u64 = 30_000_000_000;
/// Time constant of the rate estimate.
const RATE_TAU_SECS: f64 = 2.0;
/// A candidate displaces the lightest published key only if it is this much heavier, so keys of
/// similar weight do not swap back and forth (each swap costs a new epoch).
const HYSTERESIS: f64 = 1.25;

/// The published set and its counters.
#[derive(Debug)]
pub struct LocalTracker {
    max_keys: usize,
    /// This incarnation's start (`CLOCK_MONOTONIC` ns): buckets created earlier carry counts from
    /// a previous agent, which its peers already saw.
    start_ns: u64,
    /// When the published set was last chosen (a walk of the store, or a round that found new
    /// keys in the pages the program flagged).
    last_full_ns: u64,
    next_epoch: u64,
    published: HashMap<KeyName, Published>,
    retired: Vec<String>,
}

impl LocalTracker {
    /// An empty tracker publishing at most `max_keys` keys, for an agent started at `start_ns`.
    #[must_use]
    pub fn new(max_keys: usize, start_ns: u64) -> Self {
        Self {
            max_keys,
            start_ns,
            last_full_ns: start_ns,
            next_epoch: 1,
            published: HashMap::new(),
            retired: Vec::new(),
        }
    }

    /// The epoch the next key to enter will get (peers treat keys with an epoch at least the value
    /// they saw when they started counting us as new, and charge them from zero).
    #[must_use]
    pub fn next_epoch(&self) -> u64 {
        self.next_epoch
    }

    /// Keys published now.
    #[must_use]
    pub fn len(&self) -> usize {
        self.published.len()
    }

    /// Whether nothing is published.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.published.is_empty()
    }

    /// The keys to look up for a partial update.
    pub fn keys(&self) -> impl Iterator<Item = &KeyName> {
        self.published.keys()
    }

    /// Whether `key` is published.
    #[must_use]
    pub fn is_published(&self, key: &KeyName) -> bool {
        self.published.contains_key(key)
    }

    /// Most keys published.
    #[must_use]
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// Folds in what the buckets show at `now`. `seen` holds the published keys' buckets (a
    /// published key missing from it has no bucket now); with `full` it also holds candidates
    /// (after a walk of the store, the heaviest of every bucket of a cluster-scoped rule; in a
    /// round that found new keys, those), and the published set is chosen anew: the heaviest keys
    /// first, at most `max_keys`. A key idle for [`IDLE_NS`] leaves only once its bucket is gone:
    /// while it is here the key's budget is divided with it, idle or not, and a key that left
    /// would give every other holder a larger part (all of it, once none is left) and its bucket
    /// the whole rate here, so that a source idle long enough found a whole burst at every host
    /// (see [`super::charge`]). Heavier keys still displace it.
    pub fn update(&mut self, now: u64, seen: &HashMap<KeyName, BucketObs>, full: bool) {
        for (name, p) in &mut self.published {
            let (gained_pkts, gained_bytes, gained_demand, created) = match seen.get(name) {
                // Same life of the bucket: what it gained since the last look. The packet counter
                // is 32 bits and wraps; either counter may step back a little when two CPUs
                // update the bucket at once (`counter_advance`): that is no gain, and the last
                // value stays the higher one, so nothing is counted twice.
                #[expect(clippy::cast_possible_truncation, reason = "32-bit counters")]
                Some(b) if b.created_ns == p.created_ns => {
                    let pkts =
                        ratelimit_common::counter_advance(b.passed_pkts as u32, p.last_pkts as u32);
                    let bytes = b.passed_bytes.checked_sub(p.last_bytes);
                    let demand =
                        ratelimit_common::counter_advance(b.demand() as u32, p.last_demand as u32);
                    if pkts.is_some() {
                        p.last_pkts = b.passed_pkts;
                    }
                    if bytes.is_some() {
                        p.last_bytes = b.passed_bytes;
                    }
                    if demand.is_some() {
                        p.last_demand = b.demand();
                    }
                    (
                        u64::from(pkts.unwrap_or(0)),
                        bytes.unwrap_or(0),
                        u64::from(demand.unwrap_or(0)),
                        b.created_ns,
                    )
                }
                // A new life (the old one was evicted): everything it holds is new.
                Some(b) => {
                    p.last_pkts = b.passed_pkts;
                    p.last_bytes = b.passed_bytes;
                    p.last_demand = b.demand();
                    (b.passed_pkts, b.passed_bytes, b.demand(), b.created_ns)
                }
                None => (0, 0, 0, 0),
            };
            p.created_ns = created;
            #[expect(clippy::cast_precision_loss, reason = "a rate estimate")]
            let dt = (now.saturating_sub(p.last_ns) as f64 / 1e9).max(1e-3);
            let alpha = 1.0 - (-dt / RATE_TAU_SECS).exp();
            #[expect(clippy::cast_precision_loss, reason = "a rate estimate")]
            let inst = gained_demand as f64 / dt;
            p.rate += alpha * (inst - p.rate);
            p.last_ns = now;
            if gained_pkts > 0 || gained_bytes > 0 || gained_demand > 0 {
                p.count.pkts += gained_pkts;
                p.count.bytes += gained_bytes;
                p.count.demand += gained_demand;
                p.active_ns = now;
                p.dirty = true;
            }
        }
        let idle: Vec<KeyName> = self
            .published
            .iter()
            .filter(|(k, p)| now.saturating_sub(p.active_ns) > IDLE_NS && !seen.contains_key(*k))
            .map(|(k, _)| k.clone())
            .collect();
        for k in idle {
            self.retire(&k);
        }
        if full {
            self.select(now, seen);
            self.last_full_ns = now;
        }
    }

    fn retire(&mut self, name: &KeyName) {
        if self.published.remove(name).is_some() {
            self.retired.push(name.to_key());
        }
    }

    fn select(&mut self, now: u64, seen: &HashMap<KeyName, BucketObs>) {
        // Candidates: buckets not published that admitted something, by their lifetime average
        // rate (all there is without history).
        let mut candidates: Vec<(f64, &KeyName, &BucketObs)> = seen
            .iter()
            .filter(|(k, b)| b.demand() > 0 && !self.published.contains_key(*k))
            .map(|(k, b)| (candidate_rate(now, b), k, b))
            .collect();
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(b.1)));
        let mut lightest: Vec<(f64, KeyName)> = self
            .published
            .iter()
            .map(|(k, p)| (p.rate, k.clone()))
            .collect();
        lightest.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| b.1.cmp(&a.1)));
        for (rate, name, b) in candidates {
            if self.published.len() >= self.max_keys {
                match lightest.last() {
                    Some((min, _)) if rate > min * HYSTERESIS => {
                        let (_, out) = lightest.pop().expect("non-empty");
                        self.retire(&out);
                    }
                    _ => break,
                }
            }
            // A bucket born since the set was last chosen holds only consumption nobody has been
            // told about: count all of it. An older one was looked at before (and was lighter than the
            // published keys) or predates this agent: count from now on.
            let fresh = b.created_ns > self.last_full_ns && b.created_ns >= self.start_ns;
            let count = Count {
                epoch: self.next_epoch,
                pkts: if fresh { b.passed_pkts } else { 0 },
                bytes: if fresh { b.passed_bytes } else { 0 },
                demand: if fresh { b.demand() } else { 0 },
            };
            self.next_epoch += 1;
            self.published.insert(
                name.clone(),
                Published {
                    count,
                    created_ns: b.created_ns,
                    last_pkts: b.passed_pkts,
                    last_bytes: b.passed_bytes,
                    last_demand: b.demand(),
                    last_ns: now,
                    rate,
                    active_ns: now,
                    dirty: true,
                },
            );
        }
    }

    /// What changed since the last call: keys to set (with their values) and keys to delete.
    pub fn changes(&mut self) -> (Vec<(String, String)>, Vec<String>) {
        let set = self
            .published
            .iter_mut()
            .filter_map(|(k, p)| {
                std::mem::take(&mut p.dirty).then(|| (k.to_key(), p.count.to_value()))
            })
            .collect();
        (set, std::mem::take(&mut self.retired))
    }
}
