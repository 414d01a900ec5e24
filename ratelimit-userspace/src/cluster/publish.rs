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

use std::{collections::HashMap, net::IpAddr};

/// A key of a cluster-scoped limit: the rule's name (ids differ between hosts), the index of the
/// limit among the rule's (0: its own rate/burst/per, then its `[[rule.limit]]`s in order; each
/// limit has buckets of its own and is cluster- or local-scoped on its own), and the source
/// masked to that limit's granularity.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyName {
    /// Rule name.
    pub rule: String,
    /// Index of the limit (0: the rule's own; below [`ratelimit_common::MAX_LIMITS`]).
    pub limit: u8,
    /// Masked source address.
    pub addr: IpAddr,
}

/// Prefix of the chitchat keys that carry consumption: `c/RULE/ADDR` for a rule's own limit,
/// `c/RULE/K/ADDR` for its limit `K` (1..=3, a `[[rule.limit]]`).
///
/// A rule's own limit keeps the form agents before per-limit scope published, so keys of such a
/// peer are read as limit 0, which is all they ever published. Such an agent reads `c/RULE/K/ADDR`
/// as a rule named `RULE/K`, which no rule can be (a name has no `/`): ignored, never charged to
/// another rule's bucket. The sealed datagram format is unchanged (`RLC3`).
pub const KEY_PREFIX: &str = "c/";
/// The chitchat key carrying `SEQ:UNIX_MS:NEXT_EPOCH:KEYS`, written last in every sync: `KEYS`
/// is the [`keys_digest`] of the consumption keys the member publishes as of that sync (agents
/// before it wrote the first three fields only).
pub const SYNC_KEY: &str = "s";

/// A digest of a set of consumption keys (chitchat keys, `c/...`; in any order): the first 16
/// bytes of SHA-256 over them sorted, one a line, as 32 hex digits.
///
/// A member names the digest of the keys it publishes in its sync key; a peer holding keys of
/// it that do not make that digest holds keys it did not publish (a key relayed under its id by
/// another member with the cluster key, which chitchat keeps for as long as the member lives,
/// since the member never re-sets or deletes a key it does not have), and does not count its
/// idle keys as held by it (see [`super::remote::Round::holders`]). A second set with the same
/// digest takes about 2^128 tries.
#[must_use]
pub fn keys_digest<K: AsRef<str>>(keys: impl IntoIterator<Item = K>) -> String {
    use sha2::{Digest, Sha256};
    let mut keys: Vec<K> = keys.into_iter().collect();
    keys.sort_unstable_by(|a, b| a.as_ref().cmp(b.as_ref()));
    let mut h = Sha256::new();
    for k in keys {
        h.update(k.as_ref().as_bytes());
        h.update(b"\n");
    }
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The value of [`SYNC_KEY`]: sync sequence `seq`, this host's Unix time `unix_ms`, the next
/// epoch it will give a key, and the [`keys_digest`] of the consumption keys it publishes.
#[must_use]
pub fn sync_value<K: AsRef<str>>(
    seq: u64,
    unix_ms: u64,
    next_epoch: u64,
    keys: impl IntoIterator<Item = K>,
) -> String {
    format!("{seq}:{unix_ms}:{next_epoch}:{}", keys_digest(keys))
}

impl KeyName {
    /// The chitchat key.
    #[must_use]
    pub fn to_key(&self) -> String {
        if self.limit == 0 {
            format!("{KEY_PREFIX}{}/{}", self.rule, self.addr)
        } else {
            format!("{KEY_PREFIX}{}/{}/{}", self.rule, self.limit, self.addr)
        }
    }

    /// Parses a chitchat key. Only the form [`KeyName::to_key`] writes is accepted (a limit
    /// index written `0` or `01`, an address not in its canonical form are refused), so no two
    /// keys of one peer name the same bucket.
    #[must_use]
    pub fn parse(key: &str) -> Option<Self> {
        let (head, addr) = key.strip_prefix(KEY_PREFIX)?.rsplit_once('/')?;
        let (rule, limit) = match head.split_once('/') {
            None => (head, 0),
            Some((rule, k)) => {
                let k: u8 = k.parse().ok()?;
                if k == 0 || usize::from(k) >= ratelimit_common::MAX_LIMITS {
                    return None;
                }
                (rule, k)
            }
        };
        if rule.is_empty() || rule.len() > ratelimit_common::MAX_RULE_NAME {
            return None;
        }
        let name = Self {
            rule: rule.to_string(),
            limit,
            addr: addr.parse().ok()?,
        };
        (name.to_key() == key).then_some(name)
    }
}

/// A published value: `EPOCH:PKTS:BYTES:DEMAND`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Count {
    /// Epoch (see the module docs).
    pub epoch: u64,
    /// Packets admitted in this epoch.
    pub pkts: u64,
    /// Bytes admitted in this epoch.
    pub bytes: u64,
    /// Packets that reached the bucket (admitted or dropped) in this epoch.
    pub demand: u64,
}

impl Count {
    /// The chitchat value.
    #[must_use]
    pub fn to_value(&self) -> String {
        format!(
            "{}:{}:{}:{}",
            self.epoch, self.pkts, self.bytes, self.demand
        )
    }

    /// Parses a chitchat value. A value of an agent that published no demand (`EPOCH:PKTS:BYTES`,
    /// before demand-proportional shares) is read with its admitted packets as its demand.
    #[must_use]
    pub fn parse(value: &str) -> Option<Self> {
        let mut it = value.split(':');
        let (epoch, pkts, bytes) = (
            it.next()?.parse().ok()?,
            it.next()?.parse().ok()?,
            it.next()?.parse().ok()?,
        );
        let demand = match it.next() {
            None => pkts,
            Some(d) => d.parse().ok()?,
        };
        it.next().is_none().then_some(Self {
            epoch,
            pkts,
            bytes,
            demand,
        })
    }
}

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

/// A candidate's weight for the published set: its lifetime average demand (packets that
/// reached it, admitted or dropped; all there is without history), at `now`.
#[must_use]
pub fn candidate_rate(now: u64, b: &BucketObs) -> f64 {
    #[expect(clippy::cast_precision_loss, reason = "a rate estimate")]
    let age = (now.saturating_sub(b.created_ns) as f64 / 1e9).max(1.0);
    #[expect(clippy::cast_precision_loss, reason = "a rate estimate")]
    let rate = b.demand() as f64 / age;
    rate
}

/// The `k` heaviest candidates of a full scan, in bounded memory: the scan offers every bucket
/// that is not published, and only those [`LocalTracker::update`] could take are kept (it takes at
/// most `max_keys` candidates, heaviest first, ties by key).
pub struct Heaviest {
    k: usize,
    heap: std::collections::BinaryHeap<Ranked>,
}

/// A candidate in [`Heaviest`]: ordered heaviest first (less), then by key.
struct Ranked(f64, KeyName, BucketObs);

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}
impl Eq for Ranked {}
impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .0
            .total_cmp(&self.0)
            .then_with(|| self.1.cmp(&other.1))
    }
}

impl Heaviest {
    /// Keeps the `k` heaviest.
    #[must_use]
    pub fn new(k: usize) -> Self {
        Self {
            k,
            heap: std::collections::BinaryHeap::new(),
        }
    }

    /// Offers a candidate of weight `rate`.
    pub fn offer(&mut self, rate: f64, key: KeyName, b: BucketObs) {
        let r = Ranked(rate, key, b);
        if self.heap.len() < self.k {
            self.heap.push(r);
        } else if self.heap.peek().is_some_and(|worst| r < *worst) {
            self.heap.pop();
            self.heap.push(r);
        }
    }

    /// The candidates kept.
    pub fn into_candidates(self) -> impl Iterator<Item = (KeyName, BucketObs)> {
        self.heap.into_iter().map(|Ranked(_, k, b)| (k, b))
    }
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
    /// published key missing from it has no bucket now); after a `full` scan it holds every
    /// bucket of a cluster-scoped rule, and the published set is chosen anew: the heaviest keys
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
            // A bucket born since the last full scan holds only consumption nobody has been told
            // about: count all of it. An older one was looked at before (and was lighter than the
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

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn name(i: u8) -> KeyName {
        KeyName {
            rule: "flood".into(),
            limit: 0,
            addr: IpAddr::from([198, 18, 0, i]),
        }
    }

    fn obs(created_ns: u64, pkts: u64) -> BucketObs {
        BucketObs {
            created_ns,
            passed_pkts: pkts,
            passed_bytes: pkts * 100,
            dropped_pkts: 0,
        }
    }

    #[test]
    fn key_and_value_round_trip() {
        let k = KeyName {
            rule: "dns.v6".into(),
            limit: 0,
            addr: "2001:db8::1".parse().unwrap(),
        };
        assert_eq!(KeyName::parse(&k.to_key()), Some(k));
        assert_eq!(KeyName::parse("c/x/not-an-ip"), None);
        assert_eq!(KeyName::parse("s"), None);
        let c = Count {
            epoch: 3,
            pkts: 10,
            bytes: 1000,
            demand: 40,
        };
        assert_eq!(c.to_value(), "3:10:1000:40");
        assert_eq!(Count::parse(&c.to_value()), Some(c));
        assert_eq!(Count::parse("1:2"), None);
        assert_eq!(Count::parse("1:2:3:4:5"), None);
        assert_eq!(Count::parse("1:2:3:x"), None);
        // An agent of before demand was published: its admitted packets are its demand.
        assert_eq!(
            Count::parse("1:2:3"),
            Some(Count {
                epoch: 1,
                pkts: 2,
                bytes: 3,
                demand: 2
            })
        );
    }

    /// Each limit of a rule has keys of its own: the rule's own limit keeps the form older agents
    /// publish (read as limit 0), a `[[rule.limit]]` carries its index; only the form `to_key`
    /// writes is read, so no two keys name one bucket.
    #[test]
    fn keys_of_several_limits_are_distinct_and_old_keys_are_limit_0() {
        let of = |limit: u8, addr: &str| KeyName {
            rule: "web".into(),
            limit,
            addr: addr.parse().unwrap(),
        };
        let keys = [
            of(0, "198.18.0.7"),
            of(1, "198.18.0.0"),
            of(2, "0.0.0.0"),
            of(3, "::"),
            of(1, "2001:db8::"),
        ];
        let texts: Vec<String> = keys.iter().map(KeyName::to_key).collect();
        assert_eq!(
            texts,
            [
                "c/web/198.18.0.7",
                "c/web/1/198.18.0.0",
                "c/web/2/0.0.0.0",
                "c/web/3/::",
                "c/web/1/2001:db8::"
            ]
        );
        for (k, t) in keys.iter().zip(&texts) {
            assert_eq!(KeyName::parse(t).as_ref(), Some(k), "{t}");
        }
        // The same rule and address under two limits: two keys.
        assert_ne!(of(0, "0.0.0.0").to_key(), of(1, "0.0.0.0").to_key());
        // A key as an agent without per-limit scope publishes it: the rule's own limit.
        assert_eq!(KeyName::parse("c/web/0.0.0.0"), Some(of(0, "0.0.0.0")));
        // Not the canonical form, or no such limit: refused.
        for bad in [
            "c/web/0/0.0.0.0",
            "c/web/01/0.0.0.0",
            "c/web/4/0.0.0.0",
            "c/web/255/0.0.0.0",
            "c/web/-1/0.0.0.0",
            "c/web//0.0.0.0",
            "c//1/0.0.0.0",
            "c/web/1/2/0.0.0.0",
            "c/web/1/2001:DB8::",
            "c/web/2001:0db8::1",
            "c/web/1/",
        ] {
            assert_eq!(KeyName::parse(bad), None, "{bad}");
        }
    }

    /// A peer's key names a rule of at most `MAX_RULE_NAME` bytes (what a config accepts): one
    /// byte more is refused, not looked up (found missed by cargo-mutants: `>` as `==`).
    #[test]
    fn a_key_naming_a_rule_longer_than_a_rule_name_is_refused() {
        let longest = "r".repeat(ratelimit_common::MAX_RULE_NAME);
        let key = format!("c/{longest}/1/198.18.0.0");
        assert_eq!(
            KeyName::parse(&key).map(|k| k.rule.len()),
            Some(ratelimit_common::MAX_RULE_NAME)
        );
        for extra in [1, 2, 100] {
            let long = "r".repeat(ratelimit_common::MAX_RULE_NAME + extra);
            assert_eq!(
                KeyName::parse(&format!("c/{long}/198.18.0.7")),
                None,
                "+{extra}"
            );
            assert_eq!(
                KeyName::parse(&format!("c/{long}/1/198.18.0.0")),
                None,
                "+{extra}"
            );
        }
    }

    /// `Heaviest` keeps its candidates in a `BinaryHeap`, which needs `==` to agree with the
    /// order (found missed by cargo-mutants: `eq` answering false): equal weight and key are
    /// equal, another weight or key is not.
    #[test]
    fn ranked_equality_agrees_with_its_order() {
        let r = |w: f64, i: u8| Ranked(w, name(i), obs(1, 1));
        assert!(r(5.0, 1) == r(5.0, 1));
        assert!(r(5.0, 1) != r(4.0, 1));
        assert!(r(5.0, 1) != r(5.0, 2));
        assert_eq!(r(5.0, 1).cmp(&r(5.0, 1)), std::cmp::Ordering::Equal);
        // Heaviest first: the heavier ranks less.
        assert!(r(5.0, 1) < r(4.0, 1));
    }

    /// Buckets of two limits of one rule are published, counted and retired apart.
    #[test]
    fn buckets_of_two_limits_are_published_apart() {
        let start = 10 * S;
        let mut t = LocalTracker::new(10, start);
        assert_eq!((t.len(), t.is_empty()), (0, true));
        let (own, agg) = (
            name(1),
            KeyName {
                rule: "flood".into(),
                limit: 1,
                addr: IpAddr::from([0, 0, 0, 0]),
            },
        );
        let born = start + S / 2;
        t.update(
            start + S,
            &HashMap::from([(own.clone(), obs(born, 50)), (agg.clone(), obs(born, 400))]),
            true,
        );
        let (mut set, _) = t.changes();
        set.sort();
        // Two keys published (what `status` shows as the keys this host publishes).
        assert_eq!((t.len(), t.is_empty()), (2, false));
        assert_eq!(
            set,
            vec![
                (
                    "c/flood/1/0.0.0.0".to_string(),
                    "1:400:40000:400".to_string()
                ),
                ("c/flood/198.18.0.1".to_string(), "2:50:5000:50".to_string()),
            ]
        );
        // Only the aggregate moves: only its key is sent.
        t.update(
            start + 2 * S,
            &HashMap::from([(own.clone(), obs(born, 50)), (agg.clone(), obs(born, 900))]),
            false,
        );
        assert_eq!(
            t.changes().0,
            vec![(
                "c/flood/1/0.0.0.0".to_string(),
                "1:900:90000:900".to_string()
            )]
        );
    }

    /// With `max_keys` published, a candidate displaces the lightest published key only when it
    /// is `HYSTERESIS` (1.25x) heavier than that key's rate estimate, and a key that stops
    /// gaining loses weight (its rate estimate decays), so a lighter but steady source takes its
    /// place (found missed by cargo-mutants: `min * HYSTERESIS` as `min + HYSTERESIS`).
    #[test]
    fn a_candidate_displaces_the_lightest_key_only_when_clearly_heavier() {
        let start = 10 * S;
        let mut t = LocalTracker::new(1, start);
        // Key 1 at 100 packets/s for 20 s: its estimate settles near 100/s.
        let mut seen = HashMap::new();
        for s in 1..=20 {
            seen.insert(name(1), obs(start, 100 * s));
            t.update(start + s * S, &seen, true);
        }
        let published = |t: &LocalTracker| t.keys().cloned().collect::<Vec<_>>();
        assert_eq!(published(&t), vec![name(1)]);
        // Key 2 appears with a lifetime average of 120/s (not 1.25 x 100): key 1 stays.
        let now = start + 21 * S;
        seen.insert(name(1), obs(start, 2100));
        seen.insert(name(2), obs(now - 10 * S, 1200));
        t.update(now, &seen, true);
        assert_eq!(
            published(&t),
            vec![name(1)],
            "120/s displaced a key of 100/s"
        );
        // At 130/s (more than 1.25 x 100) it takes key 1's place.
        let now = start + 22 * S;
        seen.insert(name(1), obs(start, 2200));
        seen.insert(name(2), obs(now - 10 * S, 1300));
        t.update(now, &seen, true);
        assert_eq!(
            published(&t),
            vec![name(2)],
            "130/s did not displace a key of 100/s"
        );

        // Key 2 now stops gaining while key 3 sends a steady 20/s (key 1's bucket is gone): key
        // 2's estimate decays (time constant 2 s) below 20 / 1.25 within a few seconds, long
        // before it is idle.
        seen.remove(&name(1));
        let base = now;
        let mut displaced_at = None;
        for s in 1..=10 {
            let now = base + s * S;
            seen.insert(name(3), obs(base, 20 * s));
            t.update(now, &seen, true);
            if published(&t) == vec![name(3)] {
                displaced_at = Some(s);
                break;
            }
        }
        let s = displaced_at.expect("a key that stopped gaining kept its place for 10 s");
        assert!(s <= 8, "displaced only after {s} s");
    }

    /// A key's rate estimate is an exponential average: it climbs towards a steady rate without
    /// passing it, and once the key gains nothing it decays towards 0 without going below
    /// (found missed by cargo-mutants: `1.0 - e^(-dt/tau)` as `1.0 + ...`, which overshoots and
    /// swings negative).
    #[test]
    fn a_keys_rate_estimate_neither_overshoots_nor_goes_negative() {
        let start = 10 * S;
        let mut t = LocalTracker::new(10, start);
        let mut seen = HashMap::from([(name(1), obs(start, 10))]);
        t.update(start + S, &seen, true);
        let mut last = t.published[&name(1)].rate;
        for s in 2..=12 {
            seen.insert(name(1), obs(start, 10 + 100 * (s - 1)));
            t.update(start + s * S, &seen, true);
            let r = t.published[&name(1)].rate;
            assert!(
                last <= r && r <= 100.0,
                "second {s}: {r} after {last}, towards 100"
            );
            last = r;
        }
        assert!(last > 90.0, "{last} after 11 s at 100/s");
        for s in 13..=20 {
            t.update(start + s * S, &seen, true);
            let r = t.published[&name(1)].rate;
            assert!(
                (0.0..last).contains(&r),
                "second {s}: {r} after {last}, towards 0"
            );
            last = r;
        }
    }

    #[test]
    fn counts_are_cumulative_across_bucket_lives() {
        let start = 10 * S;
        let mut t = LocalTracker::new(10, start);
        // Bucket born after start: counted from its first packet.
        t.update(
            start + S,
            &HashMap::from([(name(1), obs(start + S / 2, 50))]),
            true,
        );
        let (set, del) = t.changes();
        assert_eq!(set, vec![(name(1).to_key(), "1:50:5000:50".to_string())]);
        assert!(del.is_empty());
        t.update(
            start + 2 * S,
            &HashMap::from([(name(1), obs(start + S / 2, 80))]),
            false,
        );
        assert_eq!(
            t.changes().0,
            vec![(name(1).to_key(), "1:80:8000:80".to_string())]
        );
        // Evicted: nothing gained, nothing to send.
        t.update(start + 3 * S, &HashMap::new(), false);
        assert!(t.changes().0.is_empty());
        // Back with a new life: all of it is new.
        t.update(
            start + 4 * S,
            &HashMap::from([(name(1), obs(start + 4 * S - 1, 7))]),
            false,
        );
        assert_eq!(
            t.changes().0,
            vec![(name(1).to_key(), "1:87:8700:87".to_string())]
        );
    }

    /// Two CPUs updating one bucket at once can leave its counters a little lower than a moment
    /// before (a stale write lands last). That is no consumption: the key's count stays, and the
    /// packets after it are counted from the higher value, once. (Read as a 32-bit wrap it was
    /// four billion packets, which the peers charged as debt.) A real wrap still counts.
    #[test]
    fn counters_stepping_back_count_nothing_and_wraps_count() {
        let start = 10 * S;
        let mut t = LocalTracker::new(10, start);
        let born = start + S / 2;
        t.update(start + S, &HashMap::from([(name(1), obs(born, 50))]), true);
        assert_eq!(
            t.changes().0,
            vec![(name(1).to_key(), "1:50:5000:50".to_string())]
        );
        t.update(
            start + 2 * S,
            &HashMap::from([(name(1), obs(born, 48))]),
            false,
        );
        assert!(t.changes().0.is_empty(), "a step back counted");
        t.update(
            start + 3 * S,
            &HashMap::from([(name(1), obs(born, 53))]),
            false,
        );
        assert_eq!(
            t.changes().0,
            vec![(name(1).to_key(), "1:53:5300:53".to_string())]
        );
        // The 32-bit packet counter wrapping from 2^32 - 3 to 4: 7 packets.
        let mut t = LocalTracker::new(10, start);
        let near = u64::from(u32::MAX) - 2;
        t.update(
            start + S,
            &HashMap::from([(name(2), obs(born, near))]),
            true,
        );
        let _ = t.changes();
        let mut wrapped = obs(born, 4);
        wrapped.passed_bytes = near * 100 + 700;
        t.update(start + 2 * S, &HashMap::from([(name(2), wrapped)]), false);
        let (set, _) = t.changes();
        let count = Count::parse(&set[0].1).unwrap();
        assert_eq!((count.pkts, count.bytes), (near + 7, near * 100 + 700));
    }

    #[test]
    fn adopted_buckets_count_from_now() {
        let start = 10 * S;
        let mut t = LocalTracker::new(10, start);
        t.update(
            start + S,
            &HashMap::from([(name(1), obs(start - S, 1000))]),
            true,
        );
        assert_eq!(
            t.changes().0,
            vec![(name(1).to_key(), "1:0:0:0".to_string())]
        );
        t.update(
            start + 2 * S,
            &HashMap::from([(name(1), obs(start - S, 1010))]),
            true,
        );
        assert_eq!(
            t.changes().0,
            vec![(name(1).to_key(), "1:10:1000:10".to_string())]
        );
    }

    #[test]
    fn heaviest_first_capped_and_idle_keys_retire() {
        let start = 0;
        let mut t = LocalTracker::new(2, start);
        let seen = HashMap::from([
            (name(1), obs(1, 10)),
            (name(2), obs(1, 1000)),
            (name(3), obs(1, 500)),
        ]);
        t.update(S, &seen, true);
        let mut keys: Vec<_> = t.keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, vec![name(2), name(3)]);
        t.changes();
        // Key 1 becomes far heavier than key 3: it displaces it, in a new epoch.
        let mut time = S;
        let (mut p1, mut p2, mut p3) = (10, 1000, 500);
        for _ in 0..20 {
            time += S;
            p1 += 5000;
            p2 += 1000;
            p3 += 10;
            t.update(
                time,
                &HashMap::from([
                    (name(1), obs(1, p1)),
                    (name(2), obs(1, p2)),
                    (name(3), obs(1, p3)),
                ]),
                true,
            );
        }
        let mut keys: Vec<_> = t.keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, vec![name(1), name(2)]);
        let (_, deleted) = t.changes();
        assert_eq!(deleted, vec![name(3).to_key()]);
        assert_eq!(t.next_epoch(), 4);
        // Nothing moves for longer than IDLE_NS, the buckets still here: both stay published
        // (their budget is still divided between the hosts holding them), and nothing changes.
        t.update(
            time + IDLE_NS + S,
            &HashMap::from([(name(1), obs(1, p1)), (name(2), obs(1, p2))]),
            false,
        );
        assert_eq!(t.len(), 2);
        assert_eq!(t.changes(), (vec![], vec![]));
        // Key 2's bucket gone: it retires; key 1's, idle but here, stays.
        t.update(
            time + IDLE_NS + 2 * S,
            &HashMap::from([(name(1), obs(1, p1))]),
            false,
        );
        assert_eq!(t.keys().cloned().collect::<Vec<_>>(), vec![name(1)]);
        assert_eq!(t.changes().1, vec![name(2).to_key()]);
        // A full scan with a lighter candidate, room for it: both published.
        t.update(
            time + IDLE_NS + 3 * S,
            &HashMap::from([(name(1), obs(1, p1)), (name(3), obs(1, p3))]),
            true,
        );
        assert_eq!(t.len(), 2);
        // Key 1 is idle (its rate decayed to nothing): a heavier candidate displaces it.
        t.update(
            time + IDLE_NS + 4 * S,
            &HashMap::from([
                (name(1), obs(1, p1)),
                (name(3), obs(1, p3)),
                (name(4), obs(time + IDLE_NS, 5000)),
            ]),
            true,
        );
        let mut keys: Vec<_> = t.keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, vec![name(3), name(4)]);
        assert_eq!(t.changes().1, vec![name(1).to_key()]);
    }

    /// The full scan keeps only the published keys and the `max_keys` heaviest others
    /// ([`Heaviest`]): the published set chosen from those is the one chosen from every bucket.
    #[test]
    fn the_bounded_scan_chooses_as_the_full_one() {
        let start = 0;
        let every = |round: u64| -> HashMap<KeyName, BucketObs> {
            (0..=255u8)
                .map(|i| {
                    // Weights that reorder between rounds, with ties.
                    let w = (u64::from(i) * 7919 * (round + 1)) % 97;
                    (name(i), obs(1, w * 10 * (round + 1)))
                })
                .collect()
        };
        let (mut full, mut bounded) = (LocalTracker::new(8, start), LocalTracker::new(8, start));
        for round in 0..6 {
            let now = (round + 2) * S;
            let seen = every(round);
            full.update(now, &seen, true);
            let mut heaviest = Heaviest::new(bounded.max_keys());
            let mut kept = HashMap::new();
            for (k, b) in &seen {
                if bounded.is_published(k) {
                    kept.insert(k.clone(), *b);
                } else if b.passed_pkts > 0 {
                    heaviest.offer(candidate_rate(now, b), k.clone(), *b);
                }
            }
            assert!(kept.len() <= 8);
            kept.extend(heaviest.into_candidates());
            assert!(kept.len() <= 16, "kept {}", kept.len());
            bounded.update(now, &kept, true);
            let sorted = |t: &LocalTracker| {
                let mut k: Vec<_> = t.keys().cloned().collect();
                k.sort();
                k
            };
            assert_eq!(sorted(&full), sorted(&bounded), "round {round}");
            let changes = |t: &mut LocalTracker| {
                let (mut set, mut del) = t.changes();
                set.sort();
                del.sort();
                (set, del)
            };
            assert_eq!(changes(&mut full), changes(&mut bounded), "round {round}");
        }
    }
}
