//! The records the program and the agent share through the maps: the config, the prefix trie's
//! keys and values, rules and their limits, bucket keys and buckets (with the fields packed in a
//! bucket's words), and rule names.

use core::mem::size_of;

#[cfg(doc)]
use crate::{
    action, bucket_hash, bucket_header, config_flags, family, layout, map_names, share_cost,
    tcp_flags, BUCKET_BUSY, BUCKET_WAYS,
};
use crate::{rule_flags, MAX_RULES};

/// The single record of [`map_names::CONFIG`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// Rule-set epoch: counts installs (wrapping). Its low bit is the half of the prefix trie in
    /// force (see [`prefix_generation`]): the agent writes a complete rule set under the other
    /// half and then writes this word once, so a packet sees one set or the other. The XDP
    /// program's per-CPU classification cache is keyed by the whole epoch.
    pub generation: u32,
    /// [`config_flags`] bits.
    pub flags: u32,
    /// Secret key of the bucket store's set hash ([`bucket_hash`]): drawn at random by the agent
    /// when it creates the pins and kept with them, so sources cannot be chosen to collide and
    /// an adopted store stays addressable. Never logged or shown.
    pub seed: [u64; 2],
    /// Sets of the bucket store (its capacity / [`BUCKET_WAYS`]); 0 until the agent wrote it (the
    /// program then tracks nothing and passes: fail open).
    pub bucket_sets: u32,
    /// [`layout::STAMP`] of the agent that created the pins (0 until it initialised them): a
    /// version whose stamp differs refuses to adopt them rather than misread them.
    pub layout: u32,
    /// `CLOCK_MONOTONIC` nanoseconds until which the buckets' cluster shares
    /// ([`Bucket::share`]) hold: the agent's cluster sync moves it on every round (to the end of
    /// its lag allowance); once it is behind `now` (the agent stopped, or its rounds stalled),
    /// every bucket refills at its limit's whole rate again (fail open). 0: no shares.
    pub shares_until_ns: u64,
}
const _: () = assert!(size_of::<Config>() == 40);

/// The half of the prefix trie ([`PrefixKey::generation`]) that rule-set epoch `generation`
/// ([`Config::generation`]) lives in.
#[inline(always)]
#[must_use]
pub const fn prefix_generation(generation: u32) -> u8 {
    (generation & 1) as u8
}

/// Key of [`map_names::PREFIXES`] after the LPM trie's `prefix_len` word.
///
/// The LPM prefix length counts `generation` and `family` (16 bits) plus the source prefix length.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PrefixKey {
    /// Half of the trie: 0 or 1, see [`prefix_generation`].
    pub generation: u8,
    /// [`family`] tag.
    pub family: u8,
    /// Source address, network byte order; IPv4 in the first four bytes.
    pub addr: [u8; 16],
}
const _: () = assert!(size_of::<PrefixKey>() == 18);

/// Bits of a [`PrefixKey`] before the address: `prefix_len = PREFIX_KEY_HEADER_BITS + cidr_len`.
pub const PREFIX_KEY_HEADER_BITS: u32 = 16;

/// Most rules one prefix entry can list (its own rules plus those it inherits from shorter
/// prefixes, most specific first). Bounded because the XDP program scans the list in a loop.
pub const MAX_CANDIDATES: usize = 8;

/// Value of [`map_names::PREFIXES`]: the rules a source under this prefix may match, in order of
/// precedence (longest prefix first; within a prefix, protocol+port before protocol before any).
/// The first rule whose protocol and port match the packet wins.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleSet {
    /// Number of valid entries in `rules`.
    pub len: u32,
    /// Rule ids (indices into [`map_names::RULES`]).
    pub rules: [u32; MAX_CANDIDATES],
}
const _: () = assert!(size_of::<RuleSet>() == 4 + 4 * MAX_CANDIDATES);

/// A compiled rule: record of [`map_names::RULES`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rule {
    /// [`action`].
    pub action: u8,
    /// IP protocol number to match (6 TCP, 17 UDP, 1 ICMP, 58 ICMPv6); 0 matches any.
    pub protocol: u8,
    /// Destination port to match, host byte order; 0 matches any.
    pub dst_port: u16,
    /// [`rule_flags`] bits.
    pub flags: u32,
    /// Mask applied to the source address to form the bucket key (network byte order, as four
    /// 32-bit words read from the packet): all ones for `per = "source"`, a prefix for
    /// `per = "/24"`, zero for `per = "rule"`.
    pub src_mask: [u32; 4],
    /// Nanoseconds one packet costs (1e9 / rate).
    pub pkt_interval_ns: u64,
    /// Largest allowed advance of the bucket's theoretical arrival time past now (burst * interval).
    pub pkt_tolerance_ns: u64,
    /// Nanoseconds one byte costs, as a 48.16 fixed-point number ((1e9 << 16) / bytes_rate).
    pub byte_interval_fp: u64,
    /// Largest allowed advance of the byte clock past now (bytes_burst * 1e9 / bytes_rate).
    pub byte_tolerance_ns: u64,
    /// Generation of this rule id's buckets: set (never 0) each time the id is given to a rule,
    /// 0 while the id is free. A bucket whose [`Bucket::rule_gen`] differs is stale: ignored by
    /// every reader and recycled by the program, so a removed rule's buckets need no purge.
    pub bucket_gen: u32,
    /// TCP flag bits the rule looks at ([`tcp_flags`]); 0 looks at none. Only TCP rules set it.
    pub tcp_mask: u8,
    /// The values those bits must have: a packet matches if `flags & tcp_mask == tcp_flags`
    /// (its TCP header's byte 13; 0 for other protocols).
    pub tcp_flags: u8,
    /// Number of valid entries in `extra` (0..[`MAX_LIMITS`] - 1): the rule's limits after its
    /// first (whose fields are the ones above).
    pub extra_len: u8,
    /// Always zero.
    pub _pad: u8,
    /// The rule's second, third and fourth limits (`[[rule.limit]]`), in order: a packet passes
    /// only if it conforms to every limit, charged in order; a packet one limit drops is refunded
    /// to the limits before it (see the XDP program's `limit`).
    pub extra: [Limit; MAX_LIMITS - 1],
}
const _: () = assert!(size_of::<Rule>() == 64 + 56 * (MAX_LIMITS - 1));

/// Most limits one rule may have: its own and up to three `[[rule.limit]]`.
pub const MAX_LIMITS: usize = 4;

/// The index in [`Rule::extra`] (and a classification slot's `extra`) of limit `k` (1 ..
/// [`MAX_LIMITS`]: limit 0 is the rule's own), clamped into bounds so that the verifier sees an
/// index it can check. (A mask would not do: `MAX_LIMITS - 1` entries is not a power of two, and
/// `& (MAX_LIMITS - 2)` took limit 2 to entry 0, limit 1's.)
#[inline(always)]
#[must_use]
pub const fn extra_index(k: usize) -> usize {
    let i = k.wrapping_sub(1);
    if i < MAX_LIMITS - 1 {
        i
    } else {
        MAX_LIMITS - 2
    }
}

/// A rule's bucket key holds its id in the low [`LIMIT_SHIFT`] bits of [`Bucket::rule`] and the
/// index of the limit (0: the rule's own) above: each limit of a rule has its own buckets.
pub const LIMIT_SHIFT: u32 = 14;
const _: () = assert!(MAX_RULES <= 1 << LIMIT_SHIFT);
const _: () = assert!(MAX_LIMITS <= 1 << (16 - LIMIT_SHIFT));
const _: () =
    assert!(MAX_LIMITS <= 1 + rule_flags::gate_limit(rule_flags::GATE_LIMIT_MASK) as usize);

/// The [`BucketKey::rule`] word of limit `limit` of rule `id`.
#[inline(always)]
#[must_use]
pub const fn bucket_rule(id: u32, limit: u32) -> u32 {
    id | limit << LIMIT_SHIFT
}

/// The rule id and limit index of a [`BucketKey::rule`] word (see [`bucket_rule`]).
#[inline(always)]
#[must_use]
pub const fn split_bucket_rule(word: u32) -> (u32, usize) {
    (
        word & ((1 << LIMIT_SHIFT) - 1),
        ((word & 0xffff) >> LIMIT_SHIFT) as usize,
    )
}

/// One limit of a rule after its first ([`Rule::extra`]); the first lives in the [`Rule`]'s own
/// fields of the same names. [`Rule::limit`] gives any of them in this form.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limit {
    /// The [`rule_flags::PKT_LIMIT`], [`rule_flags::BYTE_LIMIT`] and [`rule_flags::CLUSTER`]
    /// bits, for this limit.
    pub flags: u32,
    /// Always zero.
    pub _pad: u32,
    /// As [`Rule::src_mask`], for this limit's buckets.
    pub src_mask: [u32; 4],
    /// As [`Rule::pkt_interval_ns`].
    pub pkt_interval_ns: u64,
    /// As [`Rule::pkt_tolerance_ns`].
    pub pkt_tolerance_ns: u64,
    /// As [`Rule::byte_interval_fp`].
    pub byte_interval_fp: u64,
    /// As [`Rule::byte_tolerance_ns`].
    pub byte_tolerance_ns: u64,
}
const _: () = assert!(size_of::<Limit>() == 56);

/// The bits of [`Rule::flags`] that belong to its first limit (the others' are in [`Limit::flags`]).
/// [`rule_flags::COARSE_CLOCK`] and [`rule_flags::COARSE_ONLY`] are the rule's (every limit is charged on the clock the rule
/// reads), and the agent sets it in each of its limits' flags too, where a charge sees it.
pub const LIMIT_FLAGS: u32 = rule_flags::PKT_LIMIT
    | rule_flags::BYTE_LIMIT
    | rule_flags::CLUSTER
    | rule_flags::COARSE_CLOCK
    | rule_flags::COARSE_ONLY
    | rule_flags::BORN_COARSE
    | rule_flags::FIRST_FREE;

impl Rule {
    /// Number of limits: 1 + [`Rule::extra_len`] (capped at [`MAX_LIMITS`]).
    #[inline(always)]
    #[must_use]
    pub fn limits(&self) -> usize {
        let n = 1 + self.extra_len as usize;
        if n > MAX_LIMITS {
            MAX_LIMITS
        } else {
            n
        }
    }

    /// Limit `k` (0: the rule's own fields), or `None` past the last.
    #[inline(always)]
    #[must_use]
    pub fn limit(&self, k: usize) -> Option<Limit> {
        if k == 0 {
            return Some(Limit {
                flags: self.flags & LIMIT_FLAGS,
                _pad: 0,
                src_mask: self.src_mask,
                pkt_interval_ns: self.pkt_interval_ns,
                pkt_tolerance_ns: self.pkt_tolerance_ns,
                byte_interval_fp: self.byte_interval_fp,
                byte_tolerance_ns: self.byte_tolerance_ns,
            });
        }
        if k >= self.limits() {
            return None;
        }
        Some(self.extra[k - 1])
    }

    /// Sets limit `k` (0: the rule's own fields; else `extra[k - 1]`, which must be below
    /// [`MAX_LIMITS`]; `extra_len` grows to cover it).
    pub fn set_limit(&mut self, k: usize, l: Limit) {
        if k == 0 {
            self.flags = (self.flags & !LIMIT_FLAGS) | (l.flags & LIMIT_FLAGS);
            self.src_mask = l.src_mask;
            self.pkt_interval_ns = l.pkt_interval_ns;
            self.pkt_tolerance_ns = l.pkt_tolerance_ns;
            self.byte_interval_fp = l.byte_interval_fp;
            self.byte_tolerance_ns = l.byte_tolerance_ns;
        } else {
            self.extra[k - 1] = Limit {
                flags: l.flags & LIMIT_FLAGS,
                _pad: 0,
                ..l
            };
            if self.extra_len < k as u8 {
                self.extra_len = k as u8;
            }
        }
    }
}

/// What a bucket is for: a rule and the source address masked to the rule's granularity. The
/// bucket store keeps it inside each [`Bucket`]; user space passes it around in this form.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BucketKey {
    /// Rule id.
    pub rule: u32,
    /// [`family`] tag.
    pub family: u8,
    /// Always zero.
    pub _pad: [u8; 3],
    /// Masked source address, network byte order; IPv4 in the first four bytes.
    pub addr: [u8; 16],
}
const _: () = assert!(size_of::<BucketKey>() == 24);

/// A record of the bucket store ([`map_names::BUCKETS`]): the key it is for, its GCRA state and
/// its counters, in one 64-byte cache line.
///
/// GCRA keeps the theoretical arrival time (TAT) of the next conforming packet; a packet conforms
/// if `max(tat, now) + cost - now <= tolerance`, and then advances `tat` by its cost. This is a
/// token bucket with `burst = tolerance / interval`, in one word updated by compare-and-swap.
///
/// Bytes 16..24 (`rule`, `family`, `state`, `rule_gen`) are the *header*, one little-endian u64
/// (see [`bucket_header`]): a record is claimed for a new key by a compare-and-swap of it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    /// Masked source address, network byte order; IPv4 in the first four bytes.
    pub addr: [u8; 16],
    /// Rule id.
    pub rule: u16,
    /// [`family`] tag; 0 marks an empty record.
    pub family: u8,
    /// [`BUCKET_BUSY`] while a CPU (or the agent) writes the record for a new key; else 0.
    pub state: u8,
    /// [`Rule::bucket_gen`] of the rule when the bucket was created.
    pub rule_gen: u32,
    /// Packet TAT, `CLOCK_MONOTONIC` nanoseconds.
    pub tat_ns: u64,
    /// Byte TAT, `CLOCK_MONOTONIC` nanoseconds.
    pub byte_tat_ns: u64,
    /// When the bucket was created and its share of a cluster budget, in one word: the
    /// `CLOCK_MONOTONIC` nanoseconds of its creation with the low [`SHARE_FIELD_BITS`] bits
    /// cleared (4.2 ms resolution; read with [`Bucket::created_ns`]), and in those bits the
    /// share ([`Bucket::share`], bits 0..16): this host's part of a `scope = "cluster"` limit's
    /// rate, in units of 1 / [`SHARE_ONE`], 0 for none (the whole rate); and the number of hosts
    /// holding the key as the share was computed ([`Bucket::holders`], bits 16..22): a bucket
    /// at share `s` of `h` holders holds `h x s` bursts (see `share`). The agent's cluster sync
    /// writes both every round; the XDP program reads them only for a limit with
    /// [`rule_flags::CLUSTER`] and only while [`Config::shares_until_ns`] is ahead of `now` (see
    /// [`share_cost`]).
    pub created_share: u64,
    /// Bytes passed under this bucket (cumulative).
    pub passed_bytes: u64,
    /// Packets passed under this bucket (cumulative, modulo 2^32: readers take differences with
    /// `wrapping_sub`).
    pub passed_pkts: u32,
    /// Packets dropped by this bucket, or counted as dry-run drops (cumulative, modulo 2^32).
    pub dropped_pkts: u32,
}
const _: () = assert!(size_of::<Bucket>() == 64);

/// Bits of [`Bucket::created_share`] that hold the share.
pub const SHARE_BITS: u32 = 16;
/// The share that stands for the whole rate (not storable: written as 0, "no share").
pub const SHARE_ONE: u64 = 1 << SHARE_BITS;
/// The share bits of [`Bucket::created_share`].
pub const SHARE_MASK: u64 = SHARE_ONE - 1;
/// Where [`Bucket::created_share`] keeps the number of holders.
pub const HOLDERS_SHIFT: u32 = 16;
/// The most holders a bucket records (more count as this many).
pub const HOLDERS_MAX: u64 = 63;
/// The holders bits of [`Bucket::created_share`].
pub const HOLDERS_MASK: u64 = HOLDERS_MAX << HOLDERS_SHIFT;
/// Low bits of [`Bucket::created_share`] the agent's cluster sync writes: share and holders.
pub const SHARE_FIELD_BITS: u32 = 22;
/// The bits of [`SHARE_FIELD_BITS`].
pub const SHARE_FIELD_MASK: u64 = (1 << SHARE_FIELD_BITS) - 1;
const _: () = assert!(SHARE_FIELD_MASK == SHARE_MASK | HOLDERS_MASK);

impl Bucket {
    /// `CLOCK_MONOTONIC` nanoseconds when the bucket was created (to 4.2 ms).
    #[inline(always)]
    #[must_use]
    pub const fn created_ns(&self) -> u64 {
        self.created_share & !SHARE_FIELD_MASK
    }

    /// The hosts holding the key as its share was computed (see [`Bucket::created_share`]), 0
    /// with no share.
    #[inline(always)]
    #[must_use]
    pub const fn holders(&self) -> u8 {
        ((self.created_share & HOLDERS_MASK) >> HOLDERS_SHIFT) as u8
    }

    /// This host's share of the limit's rate (see [`Bucket::created_share`]): 1..[`SHARE_ONE`]
    /// - 1 in units of 1 / [`SHARE_ONE`], or 0 for none (the whole rate).
    #[inline(always)]
    #[must_use]
    pub const fn share(&self) -> u16 {
        (self.created_share & SHARE_MASK) as u16
    }

    /// The [`Bucket::created_share`] word of a bucket created at `now` (no share).
    #[inline(always)]
    #[must_use]
    pub const fn created_at(now: u64) -> u64 {
        now & !SHARE_FIELD_MASK
    }
}

/// Longest rule name the agent accepts, in bytes.
pub const MAX_RULE_NAME: usize = 64;

/// Record of [`map_names::RULE_META`]: the name behind a rule id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleMeta {
    /// Bytes of `name` in use; 0 marks a free id.
    pub name_len: u32,
    /// Config line the rule came from (for messages), 0 if unknown.
    pub line: u32,
    /// UTF-8 rule name.
    pub name: [u8; MAX_RULE_NAME],
}
const _: () = assert!(size_of::<RuleMeta>() == 8 + MAX_RULE_NAME);

impl Default for RuleMeta {
    fn default() -> Self {
        Self {
            name_len: 0,
            line: 0,
            name: [0; MAX_RULE_NAME],
        }
    }
}
