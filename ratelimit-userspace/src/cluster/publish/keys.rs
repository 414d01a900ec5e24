//! The chitchat keys and values a host publishes: a key of a cluster-scoped limit with its
//! counters, and the sync key.

use std::net::IpAddr;

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
/// idle keys as held by it (see [`crate::cluster::remote::Round::holders`]). A second set with the same
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
