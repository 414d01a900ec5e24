//! What the program counts: the verdict and global counter indices, their per-CPU records, and
//! how a reader follows a bucket's wrapping packet counter.

use core::mem::size_of;

#[cfg(doc)]
use crate::map_names;
use crate::MAX_LIMITS;

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
    /// A key's packet passed without a bucket: the key had no record and its bucket would have
    /// been full ([`crate::first_owed`]). Not counted in [`NEW_BUCKETS`]; the key's next packet
    /// before its bucket would be full again makes the bucket, owing this one's charge.
    pub const FIRST_PACKETS: usize = 23;
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
        "first_packets",
    ];
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
