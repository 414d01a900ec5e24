//! Types shared by the ratelimit XDP program and its user-space agent.
//!
//! Everything that crosses the kernel/user boundary lives here: map names and capacities, map keys
//! and values, rule records and counters. Every type is `#[repr(C)]` with explicit padding so both
//! sides agree on the layout byte for byte; a `const` assertion pins each size. [`share`] holds
//! the arithmetic of a cluster-scoped bucket at a share, which the program charges with and the
//! agent converts with.
#![no_std]
#![deny(missing_docs)]

use core::mem::size_of;

pub mod share;

/// Names of the maps in the XDP object; they are also the file names under the pin directory.
pub mod map_names {
    /// One [`crate::Config`] record: active rule generation and global flags.
    pub const CONFIG: &str = "RL_CONFIG";
    /// [`crate::Rule`] records indexed by rule id.
    pub const RULES: &str = "RL_RULES";
    /// LPM trie from [`crate::PrefixKey`] to [`crate::RuleSet`]: which rules a source may match.
    pub const PREFIXES: &str = "RL_PREFIXES";
    /// Array of [`crate::Bucket`] records, the bucket store: set-associative by a secret-seeded
    /// hash of the bucket key (see [`crate::bucket_sets`]), [`crate::BUCKET_WAYS`] records a set,
    /// memory-mappable (`BPF_F_MMAPABLE`) so user space reads and charges it in place.
    pub const BUCKETS: &str = "RL_BUCKETS";
    /// Per-CPU array of [`crate::RuleStats`] indexed by rule id.
    pub const RULE_STATS: &str = "RL_RULE_STATS";
    /// Per-CPU array with one [`crate::GlobalStats`] record.
    pub const GLOBAL_STATS: &str = "RL_GLOBAL_STATS";
    /// LRU hash from [`crate::FragKey`] to [`crate::FragEntry`]: the classification of the first
    /// fragment of each recent fragmented datagram, which its other fragments follow.
    pub const FRAGMENTS: &str = "RL_FRAGMENTS";
    /// The first-seen table of earlier versions (replaced by the bucket store): no longer
    /// created, only removed by `detach` where an older version left it.
    pub const LEGACY_FIRST_SEEN: &str = "RL_FIRST_SEEN";
    /// [`crate::RuleMeta`] records indexed by rule id. Written and read by user space only, so a
    /// restarted agent can tell which named rule each id holds.
    pub const RULE_META: &str = "RL_RULE_META";
    /// Array of `u32` words ([`v4_table`]): for each IPv4 /16 and each half of the prefix trie,
    /// the outcome of the trie's lookup and candidate walk where one outcome holds for the whole
    /// /16, so that most IPv4 sources are classified with one array read instead of the trie.
    /// Memory-mappable: the agent writes it in place.
    pub const V4_TABLE: &str = "RL_V4_TABLE";
}

/// Name of the XDP program (the function name in `ratelimit-ebpf`).
pub const PROGRAM_NAME: &str = "ratelimit";

/// Number of rule ids: capacity of [`map_names::RULES`] and [`map_names::RULE_STATS`].
pub const MAX_RULES: u32 = 16_384;
/// Capacity of the prefix trie. Both generations live in it during a swap, so this is twice the
/// number of distinct prefixes one rule set may hold.
pub const MAX_PREFIXES: u32 = 524_288;
/// Default capacity of the bucket store (tracked sources) when the config does not say.
pub const DEFAULT_MAX_BUCKETS: u32 = 1 << 20;
/// Records per set of the bucket store.
pub const BUCKET_WAYS: u32 = 4;
/// Sets a key may live in (two choices, picked by one keyed hash; see [`bucket_sets`]): a key's
/// bucket is one of `BUCKET_CHOICES * BUCKET_WAYS` records, and a new one goes to the less
/// loaded of its sets, which keeps sets even (a single choice of 8 overflows some sets at a third
/// of capacity). Eight candidate records, so eight sources that collide all keep their buckets.
pub const BUCKET_CHOICES: u32 = 2;
/// Records a key's bucket may be in.
pub const BUCKET_CANDIDATES: u32 = BUCKET_CHOICES * BUCKET_WAYS;
/// `BPF_F_MMAPABLE` (from `linux/bpf.h`): the flag of the bucket store's array.
pub const BPF_F_MMAPABLE: u32 = 1 << 10;

/// Sets of the bucket store in one 4 KiB page (16 sets of 4 records of 64 bytes): a key's two sets
/// are in the same page (see [`bucket_sets`]).
pub const BUCKET_SETS_PER_PAGE: u32 = 16;

/// Capacity of the bucket store for `max_buckets` tracked sources: rounded up to whole pages of
/// sets.
#[inline(always)]
#[must_use]
pub const fn bucket_capacity(max_buckets: u32) -> u32 {
    let page = BUCKET_WAYS * BUCKET_SETS_PER_PAGE;
    max_buckets.div_ceil(page) * page
}

/// Capacity of [`map_names::FRAGMENTS`]: fragmented datagrams remembered at once.
pub const MAX_FRAGMENTED: u32 = 16_384;
/// How long the first fragment's classification is followed by the datagram's other fragments:
/// as long as the kernel keeps a datagram's fragments for reassembly by default (IPv4's
/// `net.ipv4.ipfrag_time` is 30 s, IPv6's `net.ipv6.ip6frag_time` 60 s), so a fragment sent late
/// on purpose still follows its first fragment rather than being classified without ports. (A
/// host that raises those sysctls above 60 s gives late fragments that much longer to be
/// classified alone, by their source's protocol or `any` rule.) For as long, another first
/// fragment of the same datagram classified otherwise drops the datagram (an overlap that tries to
/// rewrite the ports: the kernel keeps the first copy of a duplicate fragment, so the datagram it
/// delivers is the first one judged): an IPv4 sender that reuses an identification within the
/// minute for a datagram to the same destination and protocol under another rule has that one
/// dropped (`dropped_fragment_conflicts`).
pub const FRAGMENT_TIMEOUT_NS: u64 = 60_000_000_000;

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
    /// Read the coarse (jiffy) clock instead of `bpf_ktime_get_ns`, except where a charge needs
    /// the true time (see [`crate::COARSE_LAG_TICKS`]). The agent sets it when every limit's
    /// tolerance spans many ticks, where a drop window that lags by a tick costs little, in the
    /// rule's flags and in each of its limits'.
    pub const COARSE_CLOCK: u32 = 1 << 1;
    /// The rule limits packets per second ([`crate::Rule::pkt_interval_ns`] is valid).
    pub const PKT_LIMIT: u32 = 1 << 2;
    /// The rule limits bytes per second ([`crate::Rule::byte_interval_fp`] is valid).
    pub const BYTE_LIMIT: u32 = 1 << 3;
    /// The rule's budget is shared with the cluster.
    pub const CLUSTER: u32 = 1 << 4;
    /// The rule has a `per = "rule"` packet limit (one bucket for all its sources), the one in
    /// bits [`GATE_LIMIT_SHIFT`].. (0: the rule's own): while that bucket has no token, each CPU
    /// drops the rule's packets from a drop window it keeps for the rule, before any other limit
    /// is charged or a bucket made for a new source (see the XDP program's `gate`). The agent
    /// sets it; a packet passes under the same condition either way.
    pub const GATE: u32 = 1 << 5;
    /// Where [`GATE`]'s limit index (2 bits) lives in [`crate::Rule::flags`].
    pub const GATE_LIMIT_SHIFT: u32 = 6;
    /// The bits of [`GATE_LIMIT_SHIFT`].
    pub const GATE_LIMIT_MASK: u32 = 0b11 << GATE_LIMIT_SHIFT;

    /// The limit index in rule flags `flags` (meaningful with [`GATE`]).
    #[inline(always)]
    #[must_use]
    pub const fn gate_limit(flags: u32) -> u32 {
        (flags & GATE_LIMIT_MASK) >> GATE_LIMIT_SHIFT
    }

    /// [`GATE`] with limit `k` (below [`crate::MAX_LIMITS`]) in its bits.
    #[inline(always)]
    #[must_use]
    pub const fn gate(k: u32) -> u32 {
        GATE | (k << GATE_LIMIT_SHIFT) & GATE_LIMIT_MASK
    }
}

/// Bits of [`crate::Config::flags`].
pub mod config_flags {
    /// Every rule behaves as if it had [`crate::rule_flags::DRY_RUN`].
    pub const DRY_RUN: u32 = 1 << 0;
    /// Emit aya-log debug records from the fast path (off by default: costs a ring-buffer write).
    pub const DEBUG_LOG: u32 = 1 << 1;
    /// A rule that can drop (deny, or limit) is in force. Set by the agent with each rule set's
    /// switch (see `Dataplane::install`), kept by [`DRY_RUN`]'s and [`DEBUG_LOG`]'s writes: a
    /// frame wrapped in more VLAN tags than the program walks hides its source, so any such rule
    /// could apply to it (see [`crate::global::DROPPED_VLAN_CHAINS`]).
    pub const DROPPING_RULES: u32 = 1 << 2;
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
    /// Truncated inside a VLAN tag: passed (the receiving stack discards it).
    pub const BAD_VLAN: usize = 3;
    /// Truncated IPv4 header: passed.
    pub const TRUNCATED_IPV4: usize = 4;
    /// IPv4 header with IHL < 5 or longer than the frame, or version field not 4: passed.
    pub const BAD_IPV4: usize = 5;
    /// Truncated IPv6 header or version field not 6: passed.
    pub const BAD_IPV6: usize = 6;
    /// Unfragmented packet whose TCP/UDP header or IPv6 extension header chain is cut short (the
    /// receiving stack discards it): classified without ports (and, for a cut IPv6 chain, only
    /// by rules for any protocol).
    pub const TRUNCATED_L4: usize = 7;
    /// IPv4/IPv6 fragment other than the first.
    pub const FRAGMENTS: usize = 8;
    /// Matched no rule: passed.
    pub const NO_MATCH: usize = 9;
    /// Buckets created.
    pub const NEW_BUCKETS: usize = 10;
    /// Bucket creation lost a race for its record to another CPU (passed, fail open).
    pub const BUCKET_ERRORS: usize = 11;
    /// Internal error in the program: a prefix naming a rule id without a record (a state the
    /// agent never writes), or a failed lookup of the program's own one-entry arrays: passed.
    pub const INTERNAL: usize = 12;
    /// A new bucket took the place of one that had refilled (a full bucket holds nothing a new one
    /// would not: no state lost).
    pub const EVICTED_FULL: usize = 13;
    /// A new bucket took the place of one that had not refilled: that source starts full again if
    /// it comes back (state lost; grows when the store is too small for the sources it sees).
    pub const EVICTED_LOST: usize = 14;
    /// A fragment other than the first whose first fragment was not seen (or is forgotten):
    /// classified by the rule that takes it whatever its port, or dropped where a rule that looks
    /// at the port could apply ([`DROPPED_UNMATCHED_FRAGMENTS`], counted there too).
    pub const FRAGMENTS_UNMATCHED: usize = 15;
    /// A first fragment without its whole TCP/UDP header (the tiny-fragment attack, RFC 1858),
    /// dropped because a protocol or port rule could apply to its source.
    pub const DROPPED_TINY_FRAGMENTS: usize = 16;
    /// An IPv6 header chain longer than the program walks, or a first fragment whose chain does
    /// not reach the L4 header (RFC 7112), dropped because a protocol or port rule could apply to
    /// its source.
    pub const DROPPED_LONG_CHAINS: usize = 17;
    /// A first fragment sent again for the same datagram but classified differently (an attempt
    /// to overwrite the ports that were judged): the datagram's fragments are dropped.
    pub const DROPPED_FRAGMENT_CONFLICTS: usize = 18;
    /// An IPv6 header chain longer than the program walks (or a first fragment's chain not reaching
    /// the L4 header) from a source no protocol or port rule applies to: passed, classified by
    /// its `any` rule if it has one.
    pub const LONG_CHAINS: usize = 19;
    /// A bucket charge whose compare-and-swaps all failed (other CPUs, or the cluster's charge,
    /// kept moving the bucket): judged by one atomic add instead, exactly when the bucket was not
    /// full, else dropped (a packet that would have fitted may be dropped, none admitted beyond
    /// `burst + rate x t`). Stays 0 but under extreme contention on one bucket.
    pub const CONTENDED_FALLBACKS: usize = 20;
    /// A frame wrapped in more VLAN tags than the program walks (8), whose source it therefore
    /// cannot read, dropped because a rule that can drop is in force
    /// ([`crate::config_flags::DROPPING_RULES`]): the receiving stack strips any number of
    /// priority tags (VLAN id 0) and delivers what is inside. Passed when no such rule is.
    pub const DROPPED_VLAN_CHAINS: usize = 21;
    /// A fragment other than the first whose first fragment was not seen (it comes later, or was
    /// forgotten), dropped because a rule that looks at the port or TCP flags could apply to it
    /// (for IPv6, whose later fragments do not name their datagram's protocol, at the protocol
    /// too): its
    /// datagram's rule is unknown, and the rule without ports would take a charge that the
    /// datagram's own rule never sees (a datagram sent last fragment first would pay one token of
    /// its port's limit however many fragments it has). Without it the datagram never completes;
    /// a first fragment that follows is judged by its own ports.
    pub const DROPPED_UNMATCHED_FRAGMENTS: usize = 22;
    /// Number of counters.
    pub const COUNT: usize = 24;
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
        "evicted_full",
        "evicted_lost",
        "fragments_unmatched",
        "dropped_tiny_fragments",
        "dropped_long_chains",
        "dropped_fragment_conflicts",
        "long_chains",
        "contended_fallbacks",
        "dropped_vlan_chains",
        "dropped_unmatched_fragments",
        "",
    ];
}

/// Address family tags used in keys.
pub mod family {
    /// IPv4: the address occupies the first 4 bytes of a 16-byte field, the rest is zero.
    pub const V4: u8 = 4;
    /// IPv6.
    pub const V6: u8 = 6;
    const _: () = assert!(V6 & 0xfd == V4 && V4 & 0xfd == V4);

    /// The family tag of a bucket key for a source of family `family` under a limit whose source
    /// mask (as [`crate::Limit::src_mask`]) begins with the word `mask0`: `family`, or [`V4`]
    /// when the mask is all zero (`per = "rule"`, or a prefix of length 0). Such a limit has one
    /// bucket for the rule whatever the source's family: keyed by family, a rule over both
    /// families would get a bucket, and a budget, for each.
    ///
    /// A mask is a prefix: it is all zero exactly when its first bit is clear, the top bit of the
    /// first address byte, bit 7 of the word as the masks are read (little-endian). [`V6`] with
    /// bit 1 cleared is [`V4`]. So three operations on one word: the program computes this for
    /// every key, in frames that have no register to spare (a test of all four words cost one
    /// of them a stack slot past the verifier's 512 bytes).
    #[inline(always)]
    #[must_use]
    pub const fn of_key(family: u8, mask0: u32) -> u8 {
        family & (0xfd | ((mask0 >> 6) & 2) as u8)
    }
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

/// The IPv4 table ([`map_names::V4_TABLE`]): a direct index of the prefix trie's outcomes by
/// /16, one `u32` word per /16 and trie half.
///
/// A word other than [`TRIE`](v4_table::TRIE) holds the whole classification of every source of
/// its /16 under that half: no prefix longer than /16 lies inside the /16, and the longest prefix
/// that covers it (if any) has a first candidate rule that looks at neither protocol, port nor
/// TCP flags, so the candidate walk stops there for every packet. Any other /16 holds
/// [`TRIE`](v4_table::TRIE): the program looks in the trie, as it did before the table. A table
/// never written (zeroes) is therefore always right, only slower.
pub mod v4_table {
    /// Words per half: one per /16.
    pub const SLOTS: u32 = 1 << 16;
    /// Words per map entry: a cache line each. (The kernel lays an array's values out 8 bytes
    /// apart at least, so one `u32` a value would take twice the memory, and twice the cache.)
    pub const WORDS_PER_ENTRY: usize = 16;
    /// A map entry's value.
    pub type Entry = [u32; WORDS_PER_ENTRY];
    /// The map's capacity in entries: both halves of the trie ([`crate::prefix_generation`]),
    /// words laid out by [`index`] (word `i` is word `i % 16` of entry `i / 16`).
    pub const ENTRIES: u32 = 2 * SLOTS / WORDS_PER_ENTRY as u32;
    /// Look in the trie.
    pub const TRIE: u32 = 0;
    /// Set in a word that holds the outcome: [`NO_RULE`] or a rule id + 1 in the low bits.
    pub const DIRECT: u32 = 1 << 31;
    /// The low bits of a [`DIRECT`] word when no prefix covers the /16.
    pub const NO_RULE: u32 = 0;

    /// The word of a /16 whose sources all fall under rule `id` (`None`: under no rule).
    #[must_use]
    pub const fn direct(id: Option<u32>) -> u32 {
        match id {
            Some(id) => DIRECT | (id + 1),
            None => DIRECT | NO_RULE,
        }
    }

    /// What `word` holds: `None`, look in the trie; else the rule every source of its /16 falls
    /// under (`Some(None)`: none). The inverse of [`direct`].
    #[inline(always)]
    #[must_use]
    pub const fn outcome(word: u32) -> Option<Option<u32>> {
        if word & DIRECT == 0 {
            return None;
        }
        match word & !DIRECT {
            NO_RULE => Some(None),
            low => Some(Some(low - 1)),
        }
    }

    /// Index of the word of the /16 of `addr` (an IPv4 address's bytes, network order) in trie
    /// half `generation` (0 or 1), counted over the whole map.
    #[inline(always)]
    #[must_use]
    pub const fn index(generation: u8, addr: [u8; 2]) -> u32 {
        ((generation as u32 & 1) << 16) | (addr[0] as u32) << 8 | addr[1] as u32
    }
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
/// [`rule_flags::COARSE_CLOCK`] is the rule's (every limit is charged on the clock the rule
/// reads), and the agent sets it in each of its limits' flags too, where a charge sees it.
pub const LIMIT_FLAGS: u32 =
    rule_flags::PKT_LIMIT | rule_flags::BYTE_LIMIT | rule_flags::CLUSTER | rule_flags::COARSE_CLOCK;

/// How far, in ticks of the coarse clock, the XDP program's coarse clock (`bpf_ktime_get_coarse_ns`,
/// cached per jiffy per CPU) is taken to lag the true time at most: 8.
///
/// The coarse clock is the time of the kernel's last timekeeping update, accumulated in whole
/// intervals of about a tick (up to a tick of remainder left out), and the update comes once a
/// tick. When the CPU that does it is held up (a vCPU the host preempted, a long section with
/// interrupts off), jiffies and the coarse clock stall until another CPU's tick forces an update,
/// after `MAX_STALLED_JIFFIES` (5) of its own ticks without one (kernel/time/tick-sched.c): the
/// remainder, the tick it took to notice, the 5 stalled ones and the update's own delay stay
/// under 8. A fixed 10 ms (one tick at HZ=100) did not hold: on a 2-vCPU VM at HZ=250 (4 ms
/// ticks) the coarse clock was seen 13.7 ms behind within 30 s under load.
///
/// A charge on the coarse clock is exact as long as the lag stays under
/// [`coarse_lag_ns`]`(tick)`: wherever the lag could change a verdict or a bucket's state (a
/// bucket that may be full, a packet the coarse clock would drop, a drop window that may be
/// over), the program reads the precise clock (see its `bucket::clock`).
pub const COARSE_LAG_TICKS: u64 = 8;

/// The lag the program allows its coarse clock on a kernel whose tick is `tick_ns` (the
/// resolution of `CLOCK_MONOTONIC_COARSE`): [`COARSE_LAG_TICKS`] ticks, of at least 1 ms (the
/// shortest tick Linux has, HZ=1000: a smaller resolution is not a tick), or
/// [`COARSE_LAG_DEFAULT_NS`] for a tick of 0 (unknown). The agent gives it to the program when
/// it loads it (the global [`COARSE_LAG_GLOBAL`]).
#[must_use]
pub const fn coarse_lag_ns(tick_ns: u64) -> u64 {
    const MIN_TICK_NS: u64 = 1_000_000;
    if tick_ns == 0 {
        COARSE_LAG_DEFAULT_NS
    } else if tick_ns < MIN_TICK_NS {
        COARSE_LAG_TICKS * MIN_TICK_NS
    } else {
        COARSE_LAG_TICKS.saturating_mul(tick_ns)
    }
}

/// The program's coarse-clock lag allowance where its loader does not set one: 8 ticks of the
/// slowest tick Linux has (HZ=100).
pub const COARSE_LAG_DEFAULT_NS: u64 = COARSE_LAG_TICKS * 10_000_000;

/// The name of the XDP program's global (a `u64`, ns) that holds its coarse-clock lag allowance
/// ([`coarse_lag_ns`] of the running kernel's tick), set by the loader.
pub const COARSE_LAG_GLOBAL: &str = "COARSE_LAG_NS";

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

/// TCP header flag bits (byte 13 of the TCP header), for [`Rule::tcp_mask`] and
/// [`Rule::tcp_flags`].
pub mod tcp_flags {
    /// FIN.
    pub const FIN: u8 = 0x01;
    /// SYN.
    pub const SYN: u8 = 0x02;
    /// RST.
    pub const RST: u8 = 0x04;
    /// PSH.
    pub const PSH: u8 = 0x08;
    /// ACK.
    pub const ACK: u8 = 0x10;
    /// URG.
    pub const URG: u8 = 0x20;
    /// ECE.
    pub const ECE: u8 = 0x40;
    /// CWR.
    pub const CWR: u8 = 0x80;
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

/// What a packet (or its bytes) costs a bucket whose share is `share` (see
/// [`Bucket::created_share`]) when its whole-rate cost is `cost` ns: `cost x SHARE_ONE / share`
/// rounded up, so the bucket refills at no more than `share / SHARE_ONE` of the rate; `cost`
/// itself for share 0 (none). A cost of 2^47 ns or more (39 hours a packet) is left as it is.
#[inline(always)]
#[must_use]
pub const fn share_cost(cost: u64, share: u64) -> u64 {
    if share == 0 || share >= SHARE_ONE || cost >= 1 << 47 {
        cost
    } else {
        (cost << SHARE_BITS).div_ceil(share)
    }
}

/// How far a bucket's 32-bit packet counter moved from `old` to `new` (it wraps), or `None` if it
/// moved back. The program counts with plain read-modify-writes, so two CPUs updating one bucket
/// in the same instant can make it step back a little (a stale write lands last); a reader that
/// took that for a wrap would see four billion packets. Keep the larger value as the next `old`.
#[inline(always)]
#[must_use]
pub const fn counter_advance(new: u32, old: u32) -> Option<u32> {
    let d = new.wrapping_sub(old);
    if d > 1 << 31 {
        None
    } else {
        Some(d)
    }
}

/// [`Bucket::state`]: the record is being written for a new key (matches no key, is no victim).
pub const BUCKET_BUSY: u8 = 1;

/// Byte offset of the header word in a [`Bucket`].
pub const BUCKET_HEADER_OFFSET: usize = 16;

/// The header word of a bucket for `rule` (id), `family` and `rule_gen`, with `state` 0: bytes
/// 16..24 of the record read as a little-endian u64.
#[inline(always)]
#[must_use]
pub const fn bucket_header(rule: u32, family: u8, rule_gen: u32) -> u64 {
    (rule as u64 & 0xffff) | (family as u64) << 16 | (rule_gen as u64) << 32
}

impl Bucket {
    /// The key this record holds.
    #[must_use]
    pub fn key(&self) -> BucketKey {
        BucketKey {
            rule: u32::from(self.rule),
            family: self.family,
            _pad: [0; 3],
            addr: self.addr,
        }
    }

    /// The header word (see [`bucket_header`]), `state` included.
    #[must_use]
    pub fn header(&self) -> u64 {
        bucket_header(u32::from(self.rule), self.family, self.rule_gen)
            | u64::from(self.state) << 24
    }
}

/// The SipHash-1-3 round function.
#[inline(always)]
fn sip_round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13) ^ v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16) ^ v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21) ^ v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17) ^ v[2];
    v[2] = v[2].rotate_left(32);
}

/// SipHash-1-3 under `seed` of a message of `len` bytes (`len` < 256, `len / 8 == N`): its whole
/// words `m` (little-endian), then its last `len % 8` bytes in the low bytes of `last` (the rest of
/// `last` zero). A keyed pseudo-random function, so whoever does not know the seed cannot choose
/// inputs that collide. SipHash takes one round per word and one for the last block: a 7-byte
/// message costs 4 rounds, 24 bytes 7.
#[inline(always)]
#[must_use]
pub fn siphash13<const N: usize>(seed: [u64; 2], m: [u64; N], last: u64, len: u8) -> u64 {
    let mut v = [
        seed[0] ^ 0x736f_6d65_7073_6575,
        seed[1] ^ 0x646f_7261_6e64_6f6d,
        seed[0] ^ 0x6c79_6765_6e65_7261,
        seed[1] ^ 0x7465_6462_7974_6573,
    ];
    let mut i = 0;
    while i < N {
        v[3] ^= m[i];
        sip_round(&mut v);
        v[0] ^= m[i];
        i += 1;
    }
    let b: u64 = (len as u64) << 56 | last;
    v[3] ^= b;
    sip_round(&mut v);
    v[0] ^= b;
    v[2] ^= 0xff;
    sip_round(&mut v);
    sip_round(&mut v);
    sip_round(&mut v);
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

/// The keyed hash of a bucket key: SipHash-1-3 under `seed` of its address and its rule (the
/// header's 16 bits: id and limit) and family, without the generation (a rule's buckets stay in
/// their sets across generations). The message is as short as the family allows: an IPv4 key's
/// 4 address bytes, the rule's 2 and the family's 1 (7 bytes: one block, 4 rounds in all); an
/// IPv6 key's 16, then the same 3 (19 bytes: 6 rounds). The family byte and SipHash's length
/// byte keep the two kinds of message apart. An IPv4 key's address bytes 4..16 are zero (see
/// [`family::V4`]) and not hashed.
#[inline(always)]
#[must_use]
pub fn bucket_hash(seed: [u64; 2], rule: u32, family: u8, addr: [u64; 2]) -> u64 {
    let tail = bucket_header(rule, family, 0);
    if family == family::V4 {
        siphash13(seed, [], addr[0] & 0xffff_ffff | tail << 32, 7)
    } else {
        siphash13(seed, addr, tail, 19)
    }
}

/// How much giving a record away loses, the bucket store's order of eviction (lowest first): see
/// [`victim_score`].
pub mod victim {
    /// Empty, or stale (its rule generation is no longer in force): nothing lost.
    pub const FREE: u64 = 0;
    /// Its bucket has refilled: nothing lost (a new bucket starts full), counted as
    /// [`crate::global::EVICTED_FULL`].
    pub const FULL: u64 = 1;
    /// From here on: in debt, `DEBT + ` the debt's time in ns (the later TAT's lead over
    /// `now`, capped at [`DEBT_CAP_NS`]): how long the bucket takes to refill, which is what an
    /// eviction hands back, compared alike under every rule (a fraction of each limit's own
    /// burst would rank one packet under a `burst = 1` limit with a bucket deep in debt under
    /// another). The source starts full again if it comes back, counted as
    /// [`crate::global::EVICTED_LOST`].
    pub const DEBT: u64 = 2;
    /// Being written by another CPU: not to be taken.
    pub const BUSY: u64 = u64::MAX;
    /// Debts longer than this (18 minutes) rank alike.
    pub const DEBT_CAP_NS: u64 = 1 << 40;
}

/// The [`victim`] score of a record with header `header` and TATs `tat`, `byte_tat` at `now`,
/// given `rule`, the current record of its rule id (`None`: no such id), whose generation says
/// whether the record is stale. `now` must not be ahead
/// of the clock of the rule's buckets (the coarse clock never is), so a bucket judged refilled
/// has refilled.
#[inline(always)]
#[must_use]
pub fn victim_score(header: u64, tat: u64, byte_tat: u64, rule: Option<&Rule>, now: u64) -> u64 {
    if (header >> 24) as u8 & BUCKET_BUSY != 0 {
        return victim::BUSY;
    }
    if (header >> 16) as u8 == 0 {
        return victim::FREE;
    }
    let Some(rule) = rule else {
        return victim::FREE;
    };
    if rule.bucket_gen == 0 || u64::from(rule.bucket_gen) != header >> 32 {
        return victim::FREE;
    }
    let later = if tat > byte_tat { tat } else { byte_tat };
    if later <= now {
        return victim::FULL;
    }
    let debt = later - now;
    victim::DEBT
        + if debt > victim::DEBT_CAP_NS {
            victim::DEBT_CAP_NS
        } else {
            debt
        }
}

/// Picks the candidate (0..[`BUCKET_CANDIDATES`], see [`bucket_candidate`]) a new key takes,
/// from each candidate's [`victim_score`] offered in order: a free record in the less occupied of
/// the two sets (the first set on a tie), else the record whose loss is least (the first on a
/// tie). Scalars only, no indexed array: the verifier can prune the program's scan loop.
#[derive(Clone, Copy, Debug)]
pub struct VictimChooser {
    used: [u32; 2],
    free: [u32; 2],
    best: u64,
    best_at: u32,
}

impl Default for VictimChooser {
    fn default() -> Self {
        Self::new()
    }
}

impl VictimChooser {
    /// Nothing offered yet.
    #[inline(always)]
    #[must_use]
    pub const fn new() -> Self {
        Self {
            used: [0; 2],
            free: [u32::MAX; 2],
            best: victim::BUSY,
            best_at: u32::MAX,
        }
    }

    /// Candidate `c` would lose `score`.
    ///
    /// Every field is read and written with a volatile access: the XDP program keeps its chooser
    /// in per-CPU map memory, where the verifier does not track values, and this keeps the
    /// compiler from holding them in registers instead (whose many constant states the verifier
    /// would check one by one). Field by field, not the whole struct: a copy of it per candidate
    /// cost tens of ns.
    #[inline(always)]
    pub fn offer(&mut self, c: u32, score: u64) {
        use core::ptr::{read_volatile as get, write_volatile as set};
        let half = usize::from(c >= BUCKET_WAYS);
        // SAFETY: fields of `self`, valid for reads and writes.
        unsafe {
            if score == victim::FREE {
                if get(&raw const self.free[half]) == u32::MAX {
                    set(&raw mut self.free[half], c);
                }
            } else {
                set(
                    &raw mut self.used[half],
                    get(&raw const self.used[half]) + 1,
                );
            }
            if score < get(&raw const self.best) {
                set(&raw mut self.best, score);
                set(&raw mut self.best_at, c);
            }
        }
    }

    /// The candidate to take and its score; `None` if every candidate is busy.
    #[inline(always)]
    #[must_use]
    pub fn choose(&self) -> Option<(u32, u64)> {
        use core::ptr::read_volatile as get;
        // SAFETY: fields of `self`, valid for reads.
        let (free, used, best, best_at) = unsafe {
            (
                [get(&raw const self.free[0]), get(&raw const self.free[1])],
                [get(&raw const self.used[0]), get(&raw const self.used[1])],
                get(&raw const self.best),
                get(&raw const self.best_at),
            )
        };
        if free[0] != u32::MAX && (free[1] == u32::MAX || used[0] <= used[1]) {
            return Some((free[0], victim::FREE));
        }
        if free[1] != u32::MAX {
            return Some((free[1], victim::FREE));
        }
        if best == victim::BUSY {
            None
        } else {
            Some((best_at, best))
        }
    }
}

/// A 16-byte address field as the two little-endian words the hash and the header compare use.
#[inline(always)]
#[must_use]
pub fn addr_words(addr: &[u8; 16]) -> [u64; 2] {
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    lo.copy_from_slice(&addr[..8]);
    hi.copy_from_slice(&addr[8..]);
    [u64::from_le_bytes(lo), u64::from_le_bytes(hi)]
}

/// The two sets (each 0..`sets`) of a key whose [`bucket_hash`] is `hash`: a page of
/// [`BUCKET_SETS_PER_PAGE`] sets from the high half of the hash (a multiply-shift, no division),
/// then two different sets of that page from the low bits: the first from bits 0..4, the second
/// one of the 15 others from bits 4..20 (a multiply-shift again). Set `s` holds records
/// `s * BUCKET_WAYS .. (s + 1) * BUCKET_WAYS`. Both in one page, so a key that is not in the
/// CPU's caches costs one TLB miss rather than two (measured: a new source's packet ~100 ns
/// less); the two choices still even out the sets of a page, and the keyed hash spreads keys
/// over the pages. Always two different sets, so every key has [`BUCKET_CANDIDATES`] records:
/// with the second set drawn from all 16, one key in 16 had the same set twice, 4 records, and 5
/// sources that shared it evicted one another (layout epoch 4).
#[inline(always)]
#[must_use]
pub const fn bucket_sets(hash: u64, sets: u32) -> [u32; 2] {
    let pages = sets / BUCKET_SETS_PER_PAGE;
    if pages == 0 {
        // A store smaller than a page (never made by `bucket_capacity`): any two sets.
        return [
            (((hash >> 32) * sets as u64) >> 32) as u32,
            (((hash & 0xffff_ffff) * sets as u64) >> 32) as u32,
        ];
    }
    let page = (((hash >> 32) * pages as u64) >> 32) as u32;
    let base = page * BUCKET_SETS_PER_PAGE;
    let first = (hash & 0xf) as u32;
    let other = ((((hash >> 4) & 0xffff) * (BUCKET_SETS_PER_PAGE as u64 - 1)) >> 16) as u32;
    let second = (first + 1 + other) & (BUCKET_SETS_PER_PAGE - 1);
    [base + first, base + second]
}

/// Record index of candidate `c` (0..[`BUCKET_CANDIDATES`]) of a key whose sets are `sets`: the
/// first set's ways, then the second's.
#[inline(always)]
#[must_use]
pub const fn bucket_candidate(sets: [u32; 2], c: u32) -> u32 {
    if c < BUCKET_WAYS {
        sets[0] * BUCKET_WAYS + c
    } else {
        sets[1] * BUCKET_WAYS + (c - BUCKET_WAYS)
    }
}

/// Key of [`map_names::FRAGMENTS`]: one fragmented datagram (RFC 791 / RFC 8200 identify one by
/// source, destination, protocol and identification).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    /// [`family`] tag.
    pub family: u8,
    /// IPv4 protocol, or the IPv6 fragment header's next header.
    pub protocol: u8,
    /// Always zero.
    pub _pad: u16,
    /// IPv4 identification (16 bits, network byte order as read) or IPv6 fragment identification.
    pub id: u32,
    /// Source address as read from the packet (IPv4 in the first word, the rest zero).
    pub src: [u32; 4],
    /// Destination address, likewise.
    pub dst: [u32; 4],
}
const _: () = assert!(size_of::<FragKey>() == 40);

/// Value of [`map_names::FRAGMENTS`]: how the datagram's first fragment was classified.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragEntry {
    /// Rule-set epoch ([`Config::generation`]) of the classification: under another, it is void.
    pub epoch: u32,
    /// Rule id, or `u32::MAX` for none.
    pub rule: u32,
    /// [`frag_flags`] bits.
    pub flags: u32,
    /// Always zero.
    pub _pad: u32,
    /// When the first fragment came (`bpf_ktime_get_coarse_ns`).
    pub time_ns: u64,
}
const _: () = assert!(size_of::<FragEntry>() == 24);

/// Bits of [`FragEntry::flags`].
pub mod frag_flags {
    /// Every fragment of the datagram is dropped (its first fragment was tiny, or sent again
    /// with another classification).
    pub const DROP: u32 = 1 << 0;
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

/// Per-rule counters, record of [`map_names::RULE_STATS`] (one copy per CPU; sum them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleStats {
    /// Packets by [`verdict`].
    pub pkts: [u64; verdict::COUNT],
    /// Bytes by [`verdict`].
    pub bytes: [u64; verdict::COUNT],
    /// Packets dropped for their packet rate ([`verdict::DROPPED_RATE`]) by each limit of the
    /// rule (0: its own, then its `[[rule.limit]]`s in order).
    pub limit_dropped_rate: [u64; MAX_LIMITS],
    /// Packets dropped for their byte rate ([`verdict::DROPPED_BYTES`]) by each limit.
    pub limit_dropped_bytes: [u64; MAX_LIMITS],
}
const _: () = assert!(size_of::<RuleStats>() == 16 * verdict::COUNT + 16 * MAX_LIMITS);

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
    // Rounded up: never less than the bytes' share of the rate. Rounded to nearest, a sender
    // choosing frame sizes whose cost fell just short of a half ns admitted 0.8% more bytes at
    // 10 Gbit/s (the error did not average out: the sender picks it).
    (len * byte_interval_fp).div_ceil(1 << 16)
}

/// The layout of everything pinned, as one number stored in the pins ([`Config::layout`]): a
/// version of ratelimit adopts pinned state only if it was created with the same stamp.
///
/// The stamp is derived at compile time from the size, alignment and field offsets of every
/// pinned record type, the number of counters, and each pinned map's type and flags; so a
/// change of any of them (even one that keeps a record's size, such as two fields swapped)
/// changes it. [`layout::EPOCH`] covers what the layout cannot show: bump it when the meaning of
/// a pinned field, counter index or flag changes.
pub mod layout {
    use core::mem::{align_of, offset_of, size_of};

    use super::{
        global, map_names, verdict, Bucket, Config, GlobalStats, Limit, PrefixKey, Rule, RuleMeta,
        RuleSet, RuleStats, BPF_F_MMAPABLE,
    };

    /// Bumped by hand when a pinned field, counter or flag changes meaning without changing the
    /// layout.
    pub const EPOCH: u64 = 4;

    /// `BPF_MAP_TYPE_ARRAY`.
    pub const MAP_ARRAY: u32 = 2;
    /// `BPF_MAP_TYPE_PERCPU_ARRAY`.
    pub const MAP_PERCPU_ARRAY: u32 = 6;
    /// `BPF_MAP_TYPE_LPM_TRIE`.
    pub const MAP_LPM_TRIE: u32 = 11;
    /// `BPF_F_NO_PREALLOC`, which an LPM trie requires.
    pub const BPF_F_NO_PREALLOC: u32 = 1;

    /// Every pinned map: (name, map type, map flags).
    pub const PINNED_MAPS: [(&str, u32, u32); 8] = [
        (map_names::CONFIG, MAP_ARRAY, 0),
        (map_names::RULES, MAP_ARRAY, 0),
        (map_names::RULE_META, MAP_ARRAY, 0),
        (map_names::PREFIXES, MAP_LPM_TRIE, BPF_F_NO_PREALLOC),
        (map_names::BUCKETS, MAP_ARRAY, BPF_F_MMAPABLE),
        (map_names::RULE_STATS, MAP_PERCPU_ARRAY, 0),
        (map_names::GLOBAL_STATS, MAP_PERCPU_ARRAY, 0),
        (map_names::V4_TABLE, MAP_ARRAY, BPF_F_MMAPABLE),
    ];

    /// This version's stamp.
    pub const STAMP: u32 = stamp();

    /// 64-bit FNV-1a step over the eight bytes of `v`.
    const fn fnv(mut h: u64, v: u64) -> u64 {
        let bytes = v.to_le_bytes();
        let mut i = 0;
        while i < 8 {
            h ^= bytes[i] as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
            i += 1;
        }
        h
    }

    const fn fnv_str(mut h: u64, s: &str) -> u64 {
        let bytes = s.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            h = fnv(h, bytes[i] as u64);
            i += 1;
        }
        fnv(h, bytes.len() as u64)
    }

    /// Folds a type's size, alignment and the offset of each named field into the hash.
    macro_rules! record {
        ($h:expr, $t:ty; $($field:ident),+) => {{
            let mut h = fnv($h, size_of::<$t>() as u64);
            h = fnv(h, align_of::<$t>() as u64);
            $( h = fnv(h, offset_of!($t, $field) as u64); )+
            h
        }};
    }

    const fn stamp() -> u32 {
        let mut h = fnv(0xcbf2_9ce4_8422_2325, EPOCH);
        h = record!(h, Config; generation, flags, seed, bucket_sets, layout, shares_until_ns);
        h = record!(h, PrefixKey; generation, family, addr);
        h = record!(h, RuleSet; len, rules);
        h = record!(
            h, Rule; action, protocol, dst_port, flags, src_mask, pkt_interval_ns,
            pkt_tolerance_ns, byte_interval_fp, byte_tolerance_ns, bucket_gen, tcp_mask, tcp_flags,
            extra_len, _pad, extra
        );
        h = record!(
            h, Limit; flags, _pad, src_mask, pkt_interval_ns, pkt_tolerance_ns, byte_interval_fp,
            byte_tolerance_ns
        );
        h = record!(
            h, Bucket; addr, rule, family, state, rule_gen, tat_ns, byte_tat_ns, created_share,
            passed_bytes, passed_pkts, dropped_pkts
        );
        h = record!(h, RuleMeta; name_len, line, name);
        h = record!(h, RuleStats; pkts, bytes, limit_dropped_rate, limit_dropped_bytes);
        h = record!(h, GlobalStats; counters);
        h = fnv(h, global::COUNT as u64);
        h = fnv(h, verdict::COUNT as u64);
        let mut i = 0;
        while i < PINNED_MAPS.len() {
            let (name, kind, flags) = PINNED_MAPS[i];
            h = fnv_str(h, name);
            h = fnv(h, kind as u64);
            h = fnv(h, flags as u64);
            i += 1;
        }
        // Never 0, which marks pins not initialised yet.
        let folded = (h ^ (h >> 32)) as u32;
        if folded == 0 {
            1
        } else {
            folded
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[repr(C)]
        struct Before {
            a: u64,
            b: u64,
            c: u32,
            d: u32,
        }
        /// `Before` with two fields swapped and one narrowed pair merged: same size.
        #[repr(C)]
        struct Swapped {
            b: u64,
            a: u64,
            c: u32,
            d: u32,
        }
        #[repr(C)]
        struct Merged {
            a: u64,
            b: u64,
            c: u64,
            d: [u8; 0],
        }

        #[test]
        fn the_stamp_sees_fields_moved_at_the_same_size() {
            assert_eq!(size_of::<Before>(), size_of::<Swapped>());
            assert_eq!(size_of::<Before>(), size_of::<Merged>());
            let before = record!(1, Before; a, b, c, d);
            assert_ne!(before, record!(1, Swapped; a, b, c, d));
            assert_ne!(before, record!(1, Merged; a, b, c, d));
            assert_eq!(before, record!(1, Before; a, b, c, d));
            assert_ne!(STAMP, 0);
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all of these are #[repr(C)], Copy, contain only integers and have no implicit
    // padding (checked by the size assertions above).
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::PrefixKey {}
    unsafe impl aya::Pod for super::RuleSet {}
    unsafe impl aya::Pod for super::Rule {}
    unsafe impl aya::Pod for super::Limit {}
    unsafe impl aya::Pod for super::BucketKey {}
    unsafe impl aya::Pod for super::Bucket {}
    unsafe impl aya::Pod for super::RuleStats {}
    unsafe impl aya::Pod for super::GlobalStats {}
    unsafe impl aya::Pod for super::RuleMeta {}
    unsafe impl aya::Pod for super::FragKey {}
    unsafe impl aya::Pod for super::FragEntry {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::hash::Hasher as _;

    #[test]
    fn an_ipv4_table_word_gives_back_what_it_was_made_from() {
        use super::v4_table::{direct, outcome, TRIE};
        assert_eq!(outcome(TRIE), None);
        assert_eq!(outcome(direct(None)), Some(None));
        for id in [0, 1, 7, MAX_RULES - 1] {
            assert_eq!(outcome(direct(Some(id))), Some(Some(id)));
        }
    }

    /// SipHash-1-3 of `bytes` under `seed` as the `siphasher` crate computes it.
    fn reference_siphash13(seed: [u64; 2], bytes: &[u8]) -> u64 {
        let mut h = siphasher::sip::SipHasher13::new_with_keys(seed[0], seed[1]);
        h.write(bytes);
        h.finish()
    }

    /// [`siphash13`] is SipHash-1-3 (checked against the `siphasher` crate's implementation on
    /// the same bytes, for messages of every length from 0 to 31 bytes), so the store's set hash
    /// is as strong as its seed.
    #[test]
    fn siphash13_is_siphash_1_3() {
        fn check<const N: usize>(seed: [u64; 2], words: [u64; 4], len: usize) {
            let mut bytes = [0u8; 32];
            for (i, w) in words.iter().enumerate() {
                bytes[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
            }
            let bytes = &bytes[..len];
            let m: [u64; N] = core::array::from_fn(|i| words[i]);
            let rest = len % 8;
            let last = if rest == 0 {
                0
            } else {
                words[N] & ((1u64 << (8 * rest)) - 1)
            };
            assert_eq!(
                siphash13(seed, m, last, len as u8),
                reference_siphash13(seed, bytes),
                "{len} bytes"
            );
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..200 {
            let seed = [next(), next()];
            let words = [next(), next(), next(), next()];
            for len in 0..32 {
                match len / 8 {
                    0 => check::<0>(seed, words, len),
                    1 => check::<1>(seed, words, len),
                    2 => check::<2>(seed, words, len),
                    _ => check::<3>(seed, words, len),
                }
            }
        }
    }

    /// [`bucket_hash`] hashes the bytes its doc names: an IPv4 key's 7, an IPv6 key's 19.
    #[test]
    fn bucket_hash_hashes_the_keys_bytes() {
        let seed = [0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210];
        let sip = |bytes: &[u8]| reference_siphash13(seed, bytes);
        let rule = 0x1234;
        let v4 = addr_words(&[198, 18, 7, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            bucket_hash(seed, rule, family::V4, v4),
            sip(&[198, 18, 7, 9, 0x34, 0x12, family::V4])
        );
        let a6 = [0x20, 1, 0xd, 0xb8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        let mut m6 = a6.to_vec();
        m6.extend_from_slice(&[0x34, 0x12, family::V6]);
        assert_eq!(
            bucket_hash(seed, rule, family::V6, addr_words(&a6)),
            sip(&m6)
        );
        // The rule and the family count: the same address under another rule, or read as the
        // other family, hashes apart.
        assert_ne!(
            bucket_hash(seed, rule, family::V4, v4),
            bucket_hash(seed, rule + 1, family::V4, v4)
        );
        assert_ne!(
            bucket_hash(seed, rule, family::V4, v4),
            bucket_hash(seed, rule, family::V6, v4)
        );
    }

    #[test]
    fn a_key_has_two_sets_in_range_and_eight_candidates() {
        let sets = 1000;
        for i in 0..10_000u64 {
            let h = siphash13([1, 2], [i], 0, 8);
            let s = bucket_sets(h, sets);
            assert!(s[0] < sets && s[1] < sets);
            let c: [u32; 8] = core::array::from_fn(|c| bucket_candidate(s, c as u32));
            assert_eq!(c[..4], [s[0] * 4, s[0] * 4 + 1, s[0] * 4 + 2, s[0] * 4 + 3]);
            assert_eq!(c[4..], [s[1] * 4, s[1] * 4 + 1, s[1] * 4 + 2, s[1] * 4 + 3]);
        }
        assert_eq!(bucket_capacity(1), 64);
        assert_eq!(bucket_capacity(1 << 20), 1 << 20);
        assert_eq!(bucket_capacity(1001), 1024);
        // Both sets in one page of 16 sets, and never the same set: 8 distinct candidates.
        for i in 0..10_000u64 {
            let s = bucket_sets(siphash13([3, 4], [i], 0, 8), 1 << 18);
            assert_eq!(s[0] / BUCKET_SETS_PER_PAGE, s[1] / BUCKET_SETS_PER_PAGE);
            assert_ne!(s[0], s[1], "key {i}");
        }
    }

    /// Every pair of different sets of a page is drawn about equally often (120 unordered
    /// pairs; none from the same set twice), so the two choices even out the page.
    #[test]
    fn a_keys_two_sets_are_different_and_spread_over_the_page() {
        let mut pairs = [[0u32; 16]; 16];
        let n = 240_000u64;
        for i in 0..n {
            let [a, b] = bucket_sets(siphash13([5, 6], [i], 0, 8), 16);
            assert_ne!(a, b, "key {i}: the same set twice");
            pairs[a.min(b) as usize][a.max(b) as usize] += 1;
        }
        let want = n as f64 / 120.0;
        for (a, row) in pairs.iter().enumerate() {
            for (b, &count) in row.iter().enumerate().skip(a + 1) {
                let got = f64::from(count);
                assert!(
                    (got / want - 1.0).abs() < 0.1,
                    "sets {a} and {b}: {got} keys, want ~{want:.0}"
                );
            }
        }
    }

    #[test]
    fn the_coarse_clocks_allowance_is_eight_ticks_of_at_least_a_ms() {
        assert_eq!(coarse_lag_ns(4_000_000), 32_000_000, "HZ=250");
        assert_eq!(coarse_lag_ns(10_000_000), 80_000_000, "HZ=100");
        assert_eq!(coarse_lag_ns(1_000_000), 8_000_000, "HZ=1000");
        assert_eq!(coarse_lag_ns(1), 8_000_000, "a resolution below any tick");
        assert_eq!(coarse_lag_ns(0), COARSE_LAG_DEFAULT_NS, "unknown");
        assert_eq!(COARSE_LAG_DEFAULT_NS, 80_000_000);
    }

    #[test]
    fn costs_round_up_so_that_no_sender_gets_more_than_the_rate() {
        // Byte costs: every frame length, at rates that divide 1e9 and rates that do not (the
        // fixed-point interval as the agent compiles it, rounded up). Rounded to nearest, a
        // sender picking lengths whose cost fell just short of half a ns paid less than its bytes.
        for rate in [
            1_250_000_000u128,
            1_000_000_000,
            333_333_333,
            123_456_789,
            1_000_000,
            7,
        ] {
            let fp = ((1_000_000_000u128 << 16).div_ceil(rate)) as u64;
            for len in 1..=9_216u64 {
                let cost = byte_cost_ns(len, fp);
                assert!(
                    u128::from(cost) * rate >= u128::from(len) * 1_000_000_000,
                    "{len} bytes at {rate} B/s cost {cost} ns: less than their time"
                );
                assert!(cost <= ((len * fp) >> 16) + 1, "rounded up by at most 1 ns");
            }
        }
        // Shares: the scaled cost is never below `cost x SHARE_ONE / share`.
        for share in [1u64, 3, 1_000, 21_845, 32_768, 65_535] {
            for cost in [1u64, 7, 999, 1_000_000, 333_333_334, (1 << 47) - 1] {
                let c = share_cost(cost, share);
                assert!(
                    u128::from(c) * u128::from(share) >= u128::from(cost) << SHARE_BITS,
                    "cost {cost} at share {share}: {c}"
                );
                assert!(u128::from(c - 1) * u128::from(share) < u128::from(cost) << SHARE_BITS);
            }
        }
    }

    #[test]
    fn each_limit_is_scored_by_its_debt_in_time() {
        // Whatever each limit's tolerance, a bucket exactly 1 ms in debt scores 1 ms.
        let mut rule = Rule {
            bucket_gen: 7,
            pkt_tolerance_ns: 1_000_000,
            byte_tolerance_ns: 1_000_000,
            ..Rule::default()
        };
        for (i, ms) in [2u64, 4, 8].into_iter().enumerate() {
            rule.extra[i].pkt_tolerance_ns = ms * 1_000_000;
            rule.extra[i].byte_tolerance_ns = ms * 1_000_000;
        }
        let now = 1_000_000_000;
        for k in 0..4u32 {
            let header = bucket_header(bucket_rule(3, k), family::V4, 7);
            let score = victim_score(header, now + 1_000_000, now, Some(&rule), now);
            assert_eq!(score, victim::DEBT + 1_000_000, "limit {k}");
        }
        assert_eq!(extra_index(1), 0);
        assert_eq!(extra_index(2), 1);
        assert_eq!(extra_index(3), 2);
        assert_eq!(extra_index(0), MAX_LIMITS - 2, "out of range: clamped");
        assert_eq!(extra_index(9), MAX_LIMITS - 2, "out of range: clamped");
    }

    /// A key's family is the source's under any mask but the all-zero one (one bucket for the
    /// rule), for prefix masks as the agent writes them: network-order bytes read little-endian.
    #[test]
    fn a_zero_mask_keys_both_families_alike() {
        for n in 0..=128u32 {
            let bits: u128 = if n == 0 { 0 } else { !0u128 << (128 - n) };
            let bytes = bits.to_be_bytes();
            let mask0 = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            assert_eq!(family::of_key(family::V4, mask0), family::V4, "/{n}");
            let v6 = if n == 0 { family::V4 } else { family::V6 };
            assert_eq!(family::of_key(family::V6, mask0), v6, "/{n}");
        }
    }

    fn choose(scores: [u64; 8]) -> Option<(u32, u64)> {
        let mut c = VictimChooser::new();
        for (i, s) in scores.into_iter().enumerate() {
            c.offer(i as u32, s);
        }
        c.choose()
    }

    #[test]
    fn victims_are_free_records_of_the_emptier_set_then_the_least_lost() {
        use victim::{BUSY, DEBT, FREE, FULL};
        // Free records: in the less occupied set, the first set on a tie.
        assert_eq!(choose([FREE; 8]), Some((0, FREE)));
        assert_eq!(
            choose([FULL, FREE, FREE, FREE, FREE, FREE, FREE, FREE]),
            Some((4, FREE))
        );
        assert_eq!(
            choose([FULL, FREE, FREE, FREE, FULL, FREE, FREE, FREE]),
            Some((1, FREE))
        );
        assert_eq!(
            choose([FULL, FULL, FULL, FULL, FULL, FULL, FULL, FREE]),
            Some((7, FREE))
        );
        // No free record: a refilled one before any in debt, the least in debt otherwise.
        assert_eq!(
            choose([DEBT + 9, DEBT + 3, FULL, DEBT, DEBT, DEBT, DEBT, DEBT]),
            Some((2, FULL))
        );
        assert_eq!(
            choose([
                DEBT + 9,
                DEBT + 3,
                DEBT + 7,
                BUSY,
                DEBT + 5,
                DEBT + 4,
                BUSY,
                DEBT + 8
            ]),
            Some((1, DEBT + 3))
        );
        assert_eq!(choose([BUSY; 8]), None);
    }

    /// Debt is compared in time, alike under every limit: one packet under a `burst = 1`
    /// limit of 1 pps (1 s to refill) ranks below a bucket 4 s in debt under a limit of burst
    /// 5 (4 of its 5 tokens spent), though it has spent its whole burst and the other 80%.
    #[test]
    fn what_eviction_loses_is_the_debt_in_time_under_any_limit() {
        const S: u64 = 1_000_000_000;
        let mut rule = Rule {
            bucket_gen: 7,
            pkt_interval_ns: S,
            pkt_tolerance_ns: S,
            ..Rule::default()
        };
        rule.set_limit(
            1,
            Limit {
                pkt_interval_ns: S,
                pkt_tolerance_ns: 5 * S,
                ..Limit::default()
            },
        );
        assert_eq!(rule.limits(), 2);
        assert_eq!(split_bucket_rule(bucket_rule(3, 1)), (3, 1));
        assert_eq!(
            split_bucket_rule(bucket_rule(MAX_RULES - 1, 3)),
            (MAX_RULES - 1, 3)
        );
        let now = 100 * S;
        let one_packet = victim_score(
            bucket_header(3, family::V4, 7),
            now + S,
            0,
            Some(&rule),
            now,
        );
        let deep = victim_score(
            bucket_header(bucket_rule(3, 1), family::V4, 7),
            now + 4 * S,
            0,
            Some(&rule),
            now,
        );
        assert_eq!(one_packet - victim::DEBT, S);
        assert_eq!(deep - victim::DEBT, 4 * S);
        // A byte debt counts as a packet debt of the same time; the later TAT decides.
        let bytes = victim_score(
            bucket_header(3, family::V4, 7),
            now,
            now + 4 * S,
            Some(&rule),
            now,
        );
        assert_eq!(bytes, deep);
        // Beyond the cap, alike.
        let h = bucket_header(3, family::V4, 7);
        assert_eq!(
            victim_score(h, now + 2 * victim::DEBT_CAP_NS, 0, Some(&rule), now),
            victim::DEBT + victim::DEBT_CAP_NS
        );
    }

    #[test]
    fn what_eviction_loses_is_judged_by_the_rule_in_force() {
        let rule = Rule {
            bucket_gen: 7,
            pkt_tolerance_ns: 1000,
            ..Rule::default()
        };
        let h = bucket_header(3, family::V4, 7);
        let now = 10_000;
        // Empty, busy, stale (other generation, freed id, no such rule).
        assert_eq!(victim_score(0, 0, 0, Some(&rule), now), victim::FREE);
        assert_eq!(
            victim_score(h | u64::from(BUCKET_BUSY) << 24, 0, 0, Some(&rule), now),
            victim::BUSY
        );
        assert_eq!(
            victim_score(
                bucket_header(3, family::V4, 6),
                now + 500,
                0,
                Some(&rule),
                now
            ),
            victim::FREE
        );
        let freed = Rule {
            bucket_gen: 0,
            ..rule
        };
        assert_eq!(
            victim_score(
                bucket_header(3, family::V4, 0),
                now + 500,
                0,
                Some(&freed),
                now
            ),
            victim::FREE
        );
        assert_eq!(victim_score(h, now + 500, 0, None, now), victim::FREE);
        // Refilled: nothing lost.
        assert_eq!(victim_score(h, now, 0, Some(&rule), now), victim::FULL);
        // In debt: by the time it takes to refill.
        let half = victim_score(h, now + 500, 0, Some(&rule), now);
        let all = victim_score(h, now + 1000, 0, Some(&rule), now);
        assert!(victim::DEBT < half && half < all, "{half} {all}");
        assert_eq!(half - victim::DEBT, 500);
    }
}
