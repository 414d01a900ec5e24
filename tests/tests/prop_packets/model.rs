//! The reference model: the bucket a frame charges (the GCRA of `bucket.rs` with every packet at
//! one instant), and what it expects of each frame.

use std::{collections::HashMap, net::IpAddr};

use ratelimit::{
    compile::{CompiledRuleSet, WithoutL4},
    config::{Action, Config, Per, RuleConfig},
};
use ratelimit_common::{
    addr_words, bucket_hash, bucket_sets, family, global, verdict, BucketKey, BUCKET_CANDIDATES,
};
use ratelimit_testbed::xdp::{XDP_DROP, XDP_PASS};

use crate::parse::{model_parse, Shape};

/// Tokens spent by one model bucket since it was created.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ModelBucket {
    pub(crate) pkts: u64,
    pub(crate) bytes: u64,
}

/// (rule id, keyed as IPv6?, source masked to the rule's `per`, left-aligned bits).
pub(crate) type BucketId = (u32, bool, u128);

/// The program's bucket key for a model bucket.
pub(crate) fn kernel_key((id, v6, bits): BucketId) -> BucketKey {
    BucketKey {
        rule: id,
        family: if v6 { family::V6 } else { family::V4 },
        _pad: [0; 3],
        addr: bits.to_be_bytes(),
    }
}

pub(crate) fn mask(len: u8) -> u128 {
    match len {
        0 => 0,
        n => !0u128 << (128 - u32::from(n)),
    }
}

pub(crate) fn bucket_of(id: u32, rule: &RuleConfig, src: IpAddr) -> BucketId {
    let (v6, bits) = match src {
        IpAddr::V4(a) => (false, u128::from(u32::from(a)) << 96),
        IpAddr::V6(a) => (true, u128::from(a)),
    };
    let len = match rule.per {
        Per::Source => 128,
        Per::Rule => 0,
        Per::Prefix(n) => n,
    };
    // A mask of length 0 (`per = "rule"`, or "/0") is the rule's one bucket, whatever the
    // source's family: the program keys it as IPv4's.
    (id, v6 && len != 0, bits & mask(len))
}

/// Charges a frame of `len` bytes to a limit rule's bucket (created full if new) and returns the
/// rule verdict: the GCRA of bucket.rs with every packet at the same instant (see the module doc).
pub(crate) fn charge(bucket: &mut ModelBucket, rule: &RuleConfig, len: u64) -> usize {
    if let Some(burst) = rule.burst.filter(|_| rule.rate.is_some()) {
        if bucket.pkts + 1 > burst {
            return verdict::DROPPED_RATE;
        }
        bucket.pkts += 1;
    }
    if let Some(bytes_burst) = rule.bytes_burst.filter(|_| rule.bytes_rate.is_some()) {
        if bucket.bytes + len > bytes_burst {
            // The packet token charged above is given back.
            if rule.rate.is_some() {
                bucket.pkts -= 1;
            }
            return verdict::DROPPED_BYTES;
        }
        bucket.bytes += len;
    }
    verdict::PASSED
}

/// What the model expects of one frame.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Expect {
    pub(crate) action: u32,
    /// Deltas of every global counter.
    pub(crate) global: [u64; global::COUNT],
    /// (rule id, verdict) whose packet counter moves by one, if a rule matched.
    pub(crate) rule: Option<(u32, usize)>,
}

/// One installed rule set and the model's state for it.
pub(crate) struct Model<'a> {
    pub(crate) set: &'a CompiledRuleSet,
    pub(crate) rules: HashMap<u32, &'a RuleConfig>,
    pub(crate) buckets: HashMap<BucketId, ModelBucket>,
    /// The bucket store's seed and sets (read from the pinned config), and how many of this
    /// case's buckets share each key's pair of sets: the model has every bucket live, so it
    /// checks that no pair is asked to hold more than its records (the store could evict; no
    /// case comes near it).
    pub(crate) seed: [u64; 2],
    pub(crate) sets: u32,
    pub(crate) per_set: HashMap<[u32; 2], u32>,
    /// Fragmented datagrams whose first fragment was seen: its rule, or the reason they drop.
    pub(crate) fragments: HashMap<Datagram, (Option<u32>, Option<usize>)>,
    pub(crate) agent_dry_run: bool,
}

/// A fragmented datagram: source, destination, protocol, identification.
pub(crate) type Datagram = (IpAddr, IpAddr, u8, u32);

impl<'a> Model<'a> {
    pub(crate) fn new(
        set: &'a CompiledRuleSet,
        config: &'a Config,
        agent_dry_run: bool,
        store: &ratelimit_common::Config,
    ) -> Self {
        let rules = config
            .rules
            .iter()
            .map(|r| (set.by_name(&r.name).expect("compiled").id, r))
            .collect();
        Self {
            set,
            rules,
            buckets: HashMap::new(),
            seed: store.seed,
            sets: store.bucket_sets,
            per_set: HashMap::new(),
            fragments: HashMap::new(),
            agent_dry_run,
        }
    }

    /// ratelimit-ebpf/src/frag.rs `remember`: the datagram's first fragment decided `id` (or
    /// `drop` for `reason`); `Some(reason)` if this fragment is dropped.
    pub(crate) fn remember(
        &mut self,
        datagram: Datagram,
        id: Option<u32>,
        drop: Option<usize>,
    ) -> Option<usize> {
        match self.fragments.get_mut(&datagram) {
            Some((_, Some(reason))) => Some(*reason),
            Some(entry) => {
                if entry.0 != id || drop.is_some() {
                    let reason = drop.unwrap_or(global::DROPPED_FRAGMENT_CONFLICTS);
                    entry.1 = Some(reason);
                    Some(reason)
                } else {
                    None
                }
            }
            None => {
                self.fragments.insert(datagram, (id, drop));
                drop
            }
        }
    }

    pub(crate) fn frame(&mut self, bytes: &[u8]) -> Expect {
        let mut g = [0u64; global::COUNT];
        g[global::PACKETS] = 1;
        let parsed = match model_parse(bytes) {
            Ok(p) => p,
            Err(global::DROPPED_VLAN_CHAINS)
                if self.rules.values().any(|r| r.action != Action::Allow) =>
            {
                // Its source is unknown, and a rule that can drop is in force.
                g[global::DROPPED_VLAN_CHAINS] += 1;
                return Expect {
                    action: if self.agent_dry_run {
                        XDP_PASS
                    } else {
                        XDP_DROP
                    },
                    global: g,
                    rule: None,
                };
            }
            Err(counter) => {
                let counter = if counter == global::DROPPED_VLAN_CHAINS {
                    global::BAD_VLAN
                } else {
                    counter
                };
                g[counter] += 1;
                return Expect {
                    action: XDP_PASS,
                    global: g,
                    rule: None,
                };
            }
        };
        match parsed.shape {
            Shape::LaterFragment => g[global::FRAGMENTS] += 1,
            Shape::Truncated | Shape::CutChain => g[global::TRUNCATED_L4] += 1,
            _ => {}
        }
        let pass = |g| Expect {
            action: XDP_PASS,
            global: g,
            rule: None,
        };
        let drop = |mut g: [u64; global::COUNT], reason: usize, dry_run: bool| {
            g[reason] += 1;
            Expect {
                action: if dry_run { XDP_PASS } else { XDP_DROP },
                global: g,
                rule: None,
            }
        };
        // The kernel's reassembly key: an IPv6 datagram's has no protocol.
        let protocol = if parsed.src.is_ipv6() {
            0
        } else {
            parsed.frag_protocol
        };
        let datagram = (parsed.src, parsed.dst, protocol, parsed.frag_id);
        let port = (parsed.dst_port != 0).then_some(parsed.dst_port);
        // The rule (id) that decides, as ratelimit-ebpf/src/main.rs `decide` does.
        let id: Option<u32> = match parsed.shape {
            Shape::FirstFragment => {
                let id = self
                    .set
                    .classify(parsed.src, parsed.protocol, port, parsed.tcp_flags)
                    .map(|c| c.id);
                if let Some(reason) = self.remember(datagram, id, None) {
                    return drop(g, reason, self.agent_dry_run);
                }
                id
            }
            Shape::LaterFragment => match self.fragments.get(&datagram) {
                Some(&(_, Some(reason))) => return drop(g, reason, self.agent_dry_run),
                Some(&(id, None)) => id,
                None => {
                    g[global::FRAGMENTS_UNMATCHED] += 1;
                    // Its datagram's rule is unknown: dropped where a rule that looks at the
                    // port (for IPv6, also the protocol) could apply (nothing remembered).
                    let without = if parsed.src.is_ipv4() {
                        self.set.classify_without_port(parsed.src, parsed.protocol)
                    } else {
                        self.set.classify_without_l4(parsed.src)
                    };
                    if let WithoutL4::Dependent = without {
                        return drop(g, global::DROPPED_UNMATCHED_FRAGMENTS, self.agent_dry_run);
                    }
                    self.set
                        .classify(parsed.src, parsed.protocol, None, 0)
                        .map(|c| c.id)
                }
            },
            Shape::TinyFragment | Shape::LongChain => {
                let id = match self.set.classify_without_l4(parsed.src) {
                    WithoutL4::Dependent => {
                        let reason = if parsed.shape == Shape::TinyFragment {
                            global::DROPPED_TINY_FRAGMENTS
                        } else {
                            global::DROPPED_LONG_CHAINS
                        };
                        if parsed.first_fragment {
                            self.remember(datagram, None, Some(reason));
                        }
                        return drop(g, reason, self.agent_dry_run);
                    }
                    WithoutL4::NoRule => None,
                    WithoutL4::Rule(r) => Some(r.id),
                };
                if parsed.shape == Shape::LongChain {
                    g[global::LONG_CHAINS] += 1;
                }
                if parsed.first_fragment {
                    if let Some(reason) = self.remember(datagram, id, None) {
                        return drop(g, reason, self.agent_dry_run);
                    }
                }
                id
            }
            Shape::CutChain => match self.set.classify_without_l4(parsed.src) {
                WithoutL4::Dependent => return pass(g),
                WithoutL4::NoRule => None,
                WithoutL4::Rule(r) => Some(r.id),
            },
            Shape::Whole | Shape::Truncated => self
                .set
                .classify(parsed.src, parsed.protocol, port, parsed.tcp_flags)
                .map(|c| c.id),
        };
        let Some(compiled) = id.and_then(|id| self.set.rule(id)) else {
            g[global::NO_MATCH] += 1;
            return pass(g);
        };
        let rule = self.rules[&compiled.id];
        let len = bytes.len() as u64;
        let v = match rule.action {
            Action::Allow => verdict::ALLOWED,
            Action::Deny => verdict::DENIED,
            Action::Limit => {
                let key = bucket_of(compiled.id, rule, parsed.src);
                if !self.buckets.contains_key(&key) {
                    // A new source: its bucket is created (full) for its first packet, in one of
                    // the records of its set.
                    g[global::NEW_BUCKETS] += 1;
                    let k = kernel_key(key);
                    let mut sets = bucket_sets(
                        bucket_hash(self.seed, k.rule, k.family, addr_words(&k.addr)),
                        self.sets,
                    );
                    sets.sort_unstable();
                    let n = self.per_set.entry(sets).or_default();
                    *n += 1;
                    assert!(
                        *n <= BUCKET_CANDIDATES,
                        "the case's sources fill sets {sets:?} past their records: the model \
                         has no evictions; use a larger store"
                    );
                }
                let bucket = self.buckets.entry(key).or_default();
                charge(bucket, rule, len)
            }
        };
        let dropped = matches!(
            v,
            verdict::DROPPED_RATE | verdict::DROPPED_BYTES | verdict::DENIED
        );
        let (v, action) = match (dropped, rule.dry_run || self.agent_dry_run) {
            (false, _) => (v, XDP_PASS),
            (true, true) => (verdict::DRY_RUN, XDP_PASS),
            (true, false) => (v, XDP_DROP),
        };
        Expect {
            action,
            global: g,
            rule: Some((compiled.id, v)),
        }
    }
}

/// The bucket model on its own: burst then drops, bytes give the packet token back.
#[test]
fn the_bucket_model_spends_bursts() {
    let mut rule = RuleConfig::new("r", "198.18.0.0/16".parse().expect("net"));
    rule.rate = Some(1);
    rule.burst = Some(3);
    let mut b = ModelBucket::default();
    let got: Vec<usize> = (0..5).map(|_| charge(&mut b, &rule, 100)).collect();
    assert_eq!(got, [0, 0, 0, verdict::DROPPED_RATE, verdict::DROPPED_RATE]);
    rule.bytes_rate = Some(1);
    rule.bytes_burst = Some(1514);
    let mut b = ModelBucket::default();
    assert_eq!(charge(&mut b, &rule, 1000), verdict::PASSED);
    assert_eq!(charge(&mut b, &rule, 1000), verdict::DROPPED_BYTES);
    assert_eq!(charge(&mut b, &rule, 500), verdict::PASSED);
    assert_eq!(charge(&mut b, &rule, 14), verdict::PASSED);
    assert_eq!((b.pkts, b.bytes), (3, 1514));
    assert_eq!(charge(&mut b, &rule, 14), verdict::DROPPED_RATE);
}
