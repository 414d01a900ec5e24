//! Types shared by the ratelimit XDP program and its user-space agent.
//!
//! Everything that crosses the kernel/user boundary lives here: map names and capacities, map keys
//! and values, rule records and counters. Every type is `#[repr(C)]` with explicit padding so both
//! sides agree on the layout byte for byte; a `const` assertion pins each size.
#![no_std]
#![deny(missing_docs)]

use core::mem::size_of;

/// Names of the maps in the XDP object; they are also the file names under the pin directory.
pub mod map_names {
    /// One [`crate::Config`] record: active rule generation and global flags.
    pub const CONFIG: &str = "RL_CONFIG";
    /// [`crate::Rule`] records indexed by rule id.
    pub const RULES: &str = "RL_RULES";
    /// LPM trie from [`crate::PrefixKey`] to [`crate::RuleSet`]: which rules a source may match.
    pub const PREFIXES: &str = "RL_PREFIXES";
    /// LRU hash from [`crate::BucketKey`] to [`crate::Bucket`]: one token bucket per tracked source.
    pub const BUCKETS: &str = "RL_BUCKETS";
    /// Per-CPU array of [`crate::RuleStats`] indexed by rule id.
    pub const RULE_STATS: &str = "RL_RULE_STATS";
    /// Per-CPU array with one [`crate::GlobalStats`] record.
    pub const GLOBAL_STATS: &str = "RL_GLOBAL_STATS";
    /// Array of [`crate::FirstSeen`] slots (shared by all CPUs): the first packet of a source not
    /// yet tracked.
    pub const FIRST_SEEN: &str = "RL_FIRST_SEEN";
    /// [`crate::RuleMeta`] records indexed by rule id. Written and read by user space only, so a
    /// restarted agent can tell which named rule each id holds.
    pub const RULE_META: &str = "RL_RULE_META";
}

/// Name of the XDP program (the function name in `ratelimit-ebpf`).
pub const PROGRAM_NAME: &str = "ratelimit";

/// Number of rule ids: capacity of [`map_names::RULES`] and [`map_names::RULE_STATS`].
pub const MAX_RULES: u32 = 16_384;
/// Capacity of the prefix trie. Both generations live in it during a swap, so this is twice the
/// number of distinct prefixes one rule set may hold.
pub const MAX_PREFIXES: u32 = 524_288;
/// Default capacity of the bucket map (tracked sources) when the config does not say.
pub const DEFAULT_MAX_BUCKETS: u32 = 1 << 20;
/// Slots of [`map_names::FIRST_SEEN`] (a power of two).
pub const FIRST_SEEN_SLOTS: u32 = 1 << 16;

/// Most rules one prefix entry can list (its own rules plus those it inherits from shorter
/// prefixes, most specific first). Bounded because the XDP program scans the list in a loop.
pub const MAX_CANDIDATES: usize = 8;

/// A rule's action.
pub mod action {
    /// Token-bucket limit.
    pub const LIMIT: u8 = 0;
    /// Always pass (and count).
    pub const ALLOW: u8 = 1;
    /// Always drop (and count).
    pub const DENY: u8 = 2;
}

/// Bits of [`crate::Rule::flags`].
pub mod rule_flags {
    /// Count would-be drops as [`crate::verdict::DRY_RUN`] and pass the packet.
    pub const DRY_RUN: u32 = 1 << 0;
    /// Read the coarse (jiffy) clock instead of `bpf_ktime_get_ns`. The agent sets it when the
    /// bucket's tolerance spans many ticks, where the coarse clock loses no accuracy.
    pub const COARSE_CLOCK: u32 = 1 << 1;
    /// The rule limits packets per second ([`crate::Rule::pkt_interval_ns`] is valid).
    pub const PKT_LIMIT: u32 = 1 << 2;
    /// The rule limits bytes per second ([`crate::Rule::byte_interval_fp`] is valid).
    pub const BYTE_LIMIT: u32 = 1 << 3;
    /// The rule's budget is shared with the cluster.
    pub const CLUSTER: u32 = 1 << 4;
}

/// Bits of [`crate::Config::flags`].
pub mod config_flags {
    /// Every rule behaves as if it had [`crate::rule_flags::DRY_RUN`].
    pub const DRY_RUN: u32 = 1 << 0;
    /// Emit aya-log debug records from the fast path (off by default: costs a ring-buffer write).
    pub const DEBUG_LOG: u32 = 1 << 1;
}

/// Indices of [`crate::RuleStats::pkts`] and [`crate::RuleStats::bytes`]: what happened to a packet
/// that matched the rule.
pub mod verdict {
    /// Within the bucket's limit: passed.
    pub const PASSED: usize = 0;
    /// Matched an `allow` rule: passed.
    pub const ALLOWED: usize = 1;
    /// Over the packet rate: dropped.
    pub const DROPPED_RATE: usize = 2;
    /// Over the byte rate: dropped.
    pub const DROPPED_BYTES: usize = 3;
    /// Matched a `deny` rule: dropped.
    pub const DENIED: usize = 4;
    /// Would have been dropped, but the rule or agent is in dry-run mode: passed.
    pub const DRY_RUN: usize = 5;
    /// Could not get a bucket (map full or update failed): passed (fail open).
    pub const NO_BUCKET: usize = 6;
    /// Number of verdicts.
    pub const COUNT: usize = 7;
    /// Names as printed by the CLI and the metrics, by index.
    pub const NAMES: [&str; COUNT] = [
        "passed",
        "allowed",
        "dropped_rate",
        "dropped_bytes",
        "denied",
        "dry_run",
        "no_bucket",
    ];
}

/// Indices of [`crate::GlobalStats::counters`].
pub mod global {
    /// Every packet the program saw.
    pub const PACKETS: usize = 0;
    /// Not IPv4 or IPv6 (ARP, LLDP...): passed.
    pub const NON_IP: usize = 1;
    /// Frame shorter than an Ethernet header: passed.
    pub const TRUNCATED_ETH: usize = 2;
    /// Truncated inside a VLAN tag, or more than two tags: passed.
    pub const BAD_VLAN: usize = 3;
    /// Truncated IPv4 header: passed.
    pub const TRUNCATED_IPV4: usize = 4;
    /// IPv4 header with IHL < 5 or longer than the frame, or version field not 4: passed.
    pub const BAD_IPV4: usize = 5;
    /// Truncated IPv6 header or version field not 6: passed.
    pub const BAD_IPV6: usize = 6;
    /// Truncated TCP/UDP header or IPv6 extension header chain: classified without ports.
    pub const TRUNCATED_L4: usize = 7;
    /// IPv4/IPv6 fragment other than the first: classified without ports.
    pub const FRAGMENTS: usize = 8;
    /// Matched no rule: passed.
    pub const NO_MATCH: usize = 9;
    /// Buckets created.
    pub const NEW_BUCKETS: usize = 10;
    /// Bucket creation failed (passed, fail open).
    pub const BUCKET_ERRORS: usize = 11;
    /// Internal error in the program (map lookup failed): passed.
    pub const INTERNAL: usize = 12;
    /// Number of counters.
    pub const COUNT: usize = 16;
    /// Names as printed by the CLI and the metrics, by index (empty: reserved).
    pub const NAMES: [&str; COUNT] = [
        "packets",
        "non_ip",
        "truncated_eth",
        "bad_vlan",
        "truncated_ipv4",
        "bad_ipv4",
        "bad_ipv6",
        "truncated_l4",
        "fragments",
        "no_match",
        "new_buckets",
        "bucket_errors",
        "internal",
        "",
        "",
        "",
    ];
}

/// Address family tags used in keys.
pub mod family {
    /// IPv4: the address occupies the first 4 bytes of a 16-byte field, the rest is zero.
    pub const V4: u8 = 4;
    /// IPv6.
    pub const V6: u8 = 6;
}

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
}
const _: () = assert!(size_of::<Config>() == 8);

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
}
const _: () = assert!(size_of::<Rule>() == 56);

/// Key of [`map_names::BUCKETS`]: a rule and the source address masked to the rule's granularity.
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

/// Value of [`map_names::BUCKETS`]: GCRA state plus counters for one source.
///
/// GCRA keeps the theoretical arrival time (TAT) of the next conforming packet; a packet conforms
/// if `max(tat, now) + cost - now <= tolerance`, and then advances `tat` by its cost. This is a
/// token bucket with `burst = tolerance / interval`, in one word updated by compare-and-swap.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    /// Packet TAT, `CLOCK_MONOTONIC` nanoseconds.
    pub tat_ns: u64,
    /// Byte TAT, `CLOCK_MONOTONIC` nanoseconds.
    pub byte_tat_ns: u64,
    /// Packets passed under this bucket (cumulative).
    pub passed_pkts: u64,
    /// Bytes passed under this bucket (cumulative).
    pub passed_bytes: u64,
    /// Packets dropped by this bucket, or counted as dry-run drops (cumulative).
    pub dropped_pkts: u64,
    /// Cluster: cumulative remote charge (ns of packet TAT) already folded into `tat_ns`.
    pub remote_applied_ns: u64,
    /// Cluster: cumulative remote charge (ns of byte TAT) already folded into `byte_tat_ns`.
    pub remote_byte_applied_ns: u64,
    /// `CLOCK_MONOTONIC` nanoseconds when the bucket was created.
    pub created_ns: u64,
}
const _: () = assert!(size_of::<Bucket>() == 64);

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

/// Slot of [`map_names::FIRST_SEEN`]: a source's first packet, admitted without a bucket.
///
/// Inserting into the bucket map costs 10-40x a lookup, and in a spoofed-source flood every packet
/// is a new source that never sends again. So a source's first packet is decided as a full bucket
/// would decide it and only remembered here (one slot per hash, shared by all CPUs so a source's
/// second packet finds its first wherever each arrived, overwritten freely); the bucket is created
/// on its second packet, charged for the first one at the time it came, so the bucket's state is
/// exactly what it would have been. A slot overwritten in between (a hash collision), or two CPUs
/// seeing a source's first packets at the same instant, lets that one first packet go uncharged.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FirstSeen {
    /// Hash of the bucket key (0: empty slot).
    pub fingerprint: u32,
    /// Length of the first packet, bytes.
    pub len: u32,
    /// When it came, in the rule's clock (ns).
    pub time_ns: u64,
}
const _: () = assert!(size_of::<FirstSeen>() == 16);

/// The 32-bit hash of a bucket key that picks its [`FirstSeen`] slot (`hash % FIRST_SEEN_SLOTS`)
/// and is stored as its fingerprint; never 0, which marks an empty slot. A multiply-xorshift mix:
/// cheap, and good enough to spread keys over the slots. Shared so tests can model the slots.
#[inline(always)]
#[must_use]
pub fn first_seen_hash(key: &BucketKey) -> u32 {
    let word = |i: usize| {
        let a = key.addr;
        u64::from_ne_bytes([
            a[i],
            a[i + 1],
            a[i + 2],
            a[i + 3],
            a[i + 4],
            a[i + 5],
            a[i + 6],
            a[i + 7],
        ])
    };
    let mut h = (u64::from(key.rule) << 8 | u64::from(key.family)) ^ 0x9e37_79b9_7f4a_7c15;
    h = (h ^ word(0)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 31) ^ word(8)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 29;
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the low 32 bits are the hash"
    )]
    let h = h as u32;
    h | 1
}

/// Per-rule counters, record of [`map_names::RULE_STATS`] (one copy per CPU; sum them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleStats {
    /// Packets by [`verdict`].
    pub pkts: [u64; verdict::COUNT],
    /// Bytes by [`verdict`].
    pub bytes: [u64; verdict::COUNT],
}
const _: () = assert!(size_of::<RuleStats>() == 16 * verdict::COUNT);

/// Global counters, the single record of [`map_names::GLOBAL_STATS`] (one copy per CPU).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GlobalStats {
    /// Counters by [`global`] index.
    pub counters: [u64; global::COUNT],
}
const _: () = assert!(size_of::<GlobalStats>() == 8 * global::COUNT);

/// Nanoseconds of byte TAT that a frame of `len` bytes costs under a rule with `byte_interval_fp`
/// ([`Rule::byte_interval_fp`]); shared so the XDP program and user space round alike.
#[inline(always)]
#[must_use]
pub const fn byte_cost_ns(len: u64, byte_interval_fp: u64) -> u64 {
    // Round to nearest so the truncation error averages out over many packets.
    (len * byte_interval_fp + (1 << 15)) >> 16
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)], Copy, contain only integers and have no implicit
    // padding (checked by the size assertions above).
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::PrefixKey {}
    unsafe impl aya::Pod for super::RuleSet {}
    unsafe impl aya::Pod for super::Rule {}
    unsafe impl aya::Pod for super::BucketKey {}
    unsafe impl aya::Pod for super::Bucket {}
    unsafe impl aya::Pod for super::RuleStats {}
    unsafe impl aya::Pod for super::GlobalStats {}
    unsafe impl aya::Pod for super::RuleMeta {}
    unsafe impl aya::Pod for super::FirstSeen {}
}
