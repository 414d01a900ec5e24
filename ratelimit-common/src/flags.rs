//! Small sets of named integers the program and the agent share: a rule's action, the bits of
//! the rule, config and TCP flag words, and the address family tags of keys.

#[cfg(doc)]
use crate::Rule;

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
    /// With [`COARSE_CLOCK`]: never read the precise clock. Every charge and every new bucket
    /// starts from `coarse + lag` (no earlier than the true time, so no interval admits more than
    /// `burst + rate x t`) and is judged against the lagging coarse time (so a full bucket
    /// withholds at most `rate x lag`: its tolerance is in effect reduced by the lag). The agent
    /// sets it where every limit's tolerance is at least [`crate::COARSE_ONLY_FACTOR`] times the
    /// lag, so that what a full bucket withholds is at most 1% of its burst; in the rule's flags
    /// and in each of its limits'.
    pub const COARSE_ONLY: u32 = 1 << 8;
    /// With [`COARSE_CLOCK`]: a drop window is judged on the coarse clock alone, so it may hold
    /// up to the lag past its end, where the precise clock would otherwise decide every packet
    /// of a flood near it (a window at 1,000 packets/s lasts 1 ms, inside the 32 ms lag at
    /// HZ=250). Nothing is lost: the agent sets it only where every limit's bucket is one
    /// source's own, not cluster-scoped, with a tolerance of at least the lag plus one packet's
    /// cost (a byte limit's: a 64 KiB frame's), so a bucket never fills while its source is
    /// held: the tokens it waits for are in its bucket when the window lets it through.
    /// Rule flags only: a window is the rule's, in the source's classification slot.
    pub const HOLD_WINDOW: u32 = 1 << 9;
    /// With [`COARSE_CLOCK`] and [`GATE`]: the per-rule limit's drop window is judged on the
    /// coarse clock alone, as [`HOLD_WINDOW`] does a source's. The agent sets it where that
    /// limit's tolerance holds the lag plus one packet and it is not cluster-scoped: its one
    /// bucket keeps the tokens while every source of the rule is held alike on a CPU, and the
    /// window's batch ([`GATE`]'s `DROP_BATCH`) ends the hold of a flood after 64 packets.
    pub const HOLD_GATE: u32 = 1 << 10;
    /// With [`COARSE_CLOCK`] (not [`COARSE_ONLY`]): a new bucket of this packet limit is made
    /// from the coarse clock, without reading the precise one, its TAT marked unsettled
    /// ([`crate::TAT_UNSETTLED`]) and its coarse birth time in its `byte_tat_ns`; the next charge,
    /// which reads the precise clock, settles it ([`crate::settle_birth`]): never fuller than
    /// exact GCRA's, at most one packet emptier until it is next full. The agent sets it in a
    /// limit's flags (the first limit's: the rule's) where the limit has no byte limit, is
    /// neither cluster-scoped nor `per = "rule"` (the per-rule window reads its TAT), and its
    /// burst holds [`crate::COARSE_ONLY_FACTOR`] packets ([`crate::born_coarse`]).
    pub const BORN_COARSE: u32 = 1 << 11;

    /// Whether a limit of `flags` makes its new buckets on the coarse clock: [`BORN_COARSE`]
    /// with the flags the agent sets it beside ([`PKT_LIMIT`], [`COARSE_CLOCK`]) and none of those
    /// it never sets it with. The XDP program reads this rather than the one bit, so that a rule
    /// record written otherwise (by hand, or by a faulty writer) cannot mark a TAT that something
    /// else reads: a byte limit's first packet would go uncharged (its birth takes the byte TAT),
    /// a cluster-scoped limit's share arithmetic reads its TAT, and a rule on the coarse clock
    /// alone ([`COARSE_ONLY`]) or on the precise one has no settle to make.
    #[must_use]
    pub const fn born_coarse_in_force(flags: u32) -> bool {
        flags & (BORN_COARSE | COARSE_CLOCK | COARSE_ONLY | CLUSTER | BYTE_LIMIT | PKT_LIMIT)
            == BORN_COARSE | COARSE_CLOCK | PKT_LIMIT
    }

    /// A key of this limit that has no bucket passes without making one while its bucket would
    /// be full (see [`crate::first_owed`]). The agent sets it where [`crate::first_packet_free`]
    /// says, in the flags of each limit it applies to (the rule's own for its first).
    pub const FIRST_FREE: u32 = 1 << 12;

    /// Whether a limit of `flags` lets its keys' first packets pass without a bucket:
    /// [`FIRST_FREE`] with a packet limit and neither a byte limit nor [`CLUSTER`], the flags the
    /// agent sets it beside ([`crate::first_packet_free`]). The XDP program reads this rather than
    /// the one bit, so that a rule record written otherwise cannot hide a cluster-scoped limit's
    /// sources from the cluster sync or give a byte limit's first packet its bytes free.
    #[must_use]
    pub const fn first_free_in_force(flags: u32) -> bool {
        flags & (FIRST_FREE | PKT_LIMIT | BYTE_LIMIT | CLUSTER) == FIRST_FREE | PKT_LIMIT
    }
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
    /// of them a stack slot).
    #[inline(always)]
    #[must_use]
    pub const fn of_key(family: u8, mask0: u32) -> u8 {
        family & (0xfd | ((mask0 >> 6) & 2) as u8)
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
