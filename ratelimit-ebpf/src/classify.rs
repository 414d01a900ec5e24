//! Classification: the rule a packet falls under.
//!
//! One LPM lookup on the source address (under the active generation) yields the candidate rules
//! for the longest matching prefix, already ordered by the agent (see `RuleSet`); the first whose
//! protocol, destination port and TCP flags match wins. For most IPv4 sources the IPv4 table
//! (`ratelimit_common::v4_table`) holds that outcome for the source's whole /16: one array read
//! instead of the trie (whose lookup, a call into the kernel, was most of a new source's
//! classification), read first, before the cache. Other sources' results are cached per CPU by
//! source (see `scratch`), keyed by the rule-set epoch, so a known source skips the trie.

use aya_ebpf::maps::lpm_trie::Key;
use ratelimit_common::{
    family, prefix_generation, v4_table, PrefixKey, MAX_CANDIDATES, PREFIX_KEY_HEADER_BITS,
};

use crate::{
    maps::{PREFIXES, RULES, V4_TABLE},
    parse::{Packet, PROTOCOL_UNKNOWN},
    scratch::{self, ClassSlot, Scratch, CLASS_SLOTS, NO_RULE, SLOT_ANY_L4, SLOT_VALID},
};

/// The rule `pkt` falls under in rule-set `epoch` (`Config::generation`), if any ([`NO_RULE`]),
/// in the low 32 bits, and the index of the cache slot that now holds that classification in the
/// next 32.
///
/// An IPv4 source whose /16 the IPv4 table decides is classified from the table alone, without
/// the cache, whose slot it then leaves as it is: the result says so ([`UNCLAIMED`]), and
/// [`claim`] makes the slot this source's before anything uses its drop window or record
/// indexes. So a packet the per-rule window drops (`limit`: every frame of a spoofed flood under
/// an exhausted aggregate) touches no slot: one of 256 lines, each frame a random one, read and
/// written in full by every such frame when the cache came first (the layered flood's largest
/// cost end to end, docs/journal.md).
#[inline(always)]
pub fn classify(pkt: &Packet, epoch: u32, s: *mut Scratch) -> u64 {
    let i = scratch::slot_index(&pkt.src);
    if i >= CLASS_SLOTS {
        return u64::from(NO_RULE);
    }
    let hit = |rule: u32| u64::from(rule) | (i as u64) << 32;
    if pkt.family == family::V4 {
        if let Some(rule) = from_table(pkt, epoch) {
            return UNCLAIMED | hit(rule.unwrap_or(NO_RULE));
        }
    }
    // SAFETY: this CPU's live map value (see `scratch::coarse_now`); `i` is in bounds.
    let slot = unsafe { &raw mut (*s).class[i] };
    // SAFETY: as above.
    let c = unsafe { *slot };
    if c.flags & SLOT_VALID != 0
        && c.epoch == epoch
        && c.src == pkt.src
        && c.family == pkt.family
        && (c.flags & SLOT_ANY_L4 != 0
            || (c.protocol == pkt.protocol
                && c.dst_port == pkt.dst_port
                && pkt.tcp_flags & c.tcp_mask == c.tcp_flags))
        && (c.rule == NO_RULE || RULES.get(c.rule).is_some())
    {
        return hit(c.rule);
    }
    let found = lookup(pkt, epoch, s);
    let rule = found as u32;
    fill(
        slot,
        pkt,
        epoch,
        rule,
        found & ANY_L4 != 0,
        (found >> TCP_MASK_SHIFT) as u8,
    );
    hit(rule)
}

/// Writes `pkt`'s classification into `slot` (`rule` under `epoch`, for any protocol and port
/// if `any_l4`, else for the packet's, with the TCP flag bits `tcp_mask` looked at) and empties
/// its drop window and record indexes.
#[inline(always)]
fn fill(slot: *mut ClassSlot, pkt: &Packet, epoch: u32, rule: u32, any_l4: bool, tcp_mask: u8) {
    // SAFETY: this CPU's live slot (the caller's).
    unsafe {
        (*slot).epoch = epoch;
        (*slot).rule = rule;
        (*slot).family = pkt.family;
        (*slot).flags = SLOT_VALID | if any_l4 { SLOT_ANY_L4 } else { 0 };
        (*slot).dst_port = pkt.dst_port;
        (*slot).protocol = pkt.protocol;
        (*slot).tcp_mask = tcp_mask;
        (*slot).tcp_flags = pkt.tcp_flags & tcp_mask;
        // Not overlapping (the packet is not in the slot): as a plain assignment, the compiler
        // calls the program's `memmove` (a byte loop behind a BPF call).
        core::ptr::copy_nonoverlapping(&raw const pkt.src, &raw mut (*slot).src, 1);
    }
    scratch::empty_slot(slot);
}

/// Bit of [`classify`]'s result: the rule came from the IPv4 table and the cache slot (at the
/// index in the result) was not looked at: [`claim`] it before using it.
pub const UNCLAIMED: u64 = 1 << 48;

/// Makes `slot`, the cache slot [`classify`] gave `pkt` with [`UNCLAIMED`], hold the packet's
/// classification (`rule`, from the IPv4 table, which holds for any protocol and port): kept as
/// it is where it already does (its drop window and record indexes with it), written and emptied
/// where it holds another source, epoch or rule.
#[inline(always)]
pub fn claim(pkt: &Packet, epoch: u32, slot: *mut ClassSlot, rule: u32) {
    // SAFETY: this CPU's live slot (the caller's).
    unsafe {
        if (*slot).flags & SLOT_VALID != 0
            && (*slot).epoch == epoch
            && (*slot).rule == rule
            && (*slot).family == pkt.family
            && (*slot).src == pkt.src
        {
            return;
        }
    }
    fill(slot, pkt, epoch, rule, true, 0);
}

/// The IPv4 table's outcome for `pkt`'s /16 under `epoch`, where it holds one (see
/// `ratelimit_common::v4_table`): the rule, or `Some(None)` for no rule.
#[inline(always)]
fn from_table(pkt: &Packet, epoch: u32) -> Option<Option<u32>> {
    // The source's bytes in network order: the first two are its /16.
    let [a, b, _, _] = pkt.src[0].to_ne_bytes();
    let i = v4_table::index(prefix_generation(epoch), [a, b]);
    let w = i as usize % v4_table::WORDS_PER_ENTRY;
    let entry = V4_TABLE.get(i / v4_table::WORDS_PER_ENTRY as u32)?;
    v4_table::outcome(entry[w])
}

/// How a packet whose L4 header is unknown (a tiny first fragment, an over-long IPv6 chain) can
/// be classified.
pub enum WithoutL4 {
    /// No rule's prefix holds the source.
    NoRule,
    /// No rule of the source's prefix looks at the protocol or port: the first one (this id)
    /// applies, whatever they are.
    Rule(u32),
    /// A rule that looks at the protocol or port could apply: the packet's shape would decide
    /// whether it is walked past.
    Dependent,
}

/// Classifies a packet whose port is unknown, and its protocol too where `protocol` is
/// [`PROTOCOL_UNKNOWN`] (not cached: such packets are rare). With a known protocol, rules of
/// other protocols are never its datagram's and are passed over, and the first rule that fits
/// whatever the port is the one (as [`lookup`] would find it).
#[inline(always)]
pub fn without_l4(pkt: &Packet, epoch: u32, protocol: u8, s: *mut Scratch) -> WithoutL4 {
    let Some(set) = PREFIXES.get(prefix_key(pkt, epoch, s)) else {
        return WithoutL4::NoRule;
    };
    let len = set.len as usize;
    let mut first = NO_RULE;
    for i in 0..MAX_CANDIDATES {
        if i >= len {
            break;
        }
        let id = set.rules[i];
        let Some(rule) = RULES.get(id) else { continue };
        let known = protocol != PROTOCOL_UNKNOWN;
        if known && rule.protocol != 0 && rule.protocol != protocol {
            continue;
        }
        if (rule.protocol != 0 && !known) || rule.dst_port != 0 || rule.tcp_mask != 0 {
            return WithoutL4::Dependent;
        }
        if known {
            return WithoutL4::Rule(id);
        }
        if first == NO_RULE {
            first = id;
        }
    }
    if first == NO_RULE {
        WithoutL4::NoRule
    } else {
        WithoutL4::Rule(first)
    }
}

/// The prefix trie key of `pkt`'s source under `epoch`, built in this CPU's scratch record
/// rather than on the stack of the frames that inline the lookup (CONSTRAINTS.md, "Stack").
#[inline(always)]
fn prefix_key(pkt: &Packet, epoch: u32, s: *mut Scratch) -> &'static Key<PrefixKey> {
    // SAFETY: this CPU's live scratch record (XDP runs with preemption disabled, and nothing else
    // of this program run uses the key once the lookup returned).
    unsafe {
        let k = &raw mut (*s).trie_key;
        (*k).prefix_len = PREFIX_KEY_HEADER_BITS + if pkt.family == family::V4 { 32 } else { 128 };
        (*k).generation = prefix_generation(epoch);
        (*k).family = pkt.family;
        // SAFETY: [u32; 4] and [u16; 8] have the same size and any bit pattern is valid for both.
        (*k).addr = core::mem::transmute::<[u32; 4], [u16; 8]>(pkt.src);
        &*k.cast::<Key<PrefixKey>>()
    }
}

/// Bit of [`lookup`]'s result: the result holds for every protocol and port.
const ANY_L4: u64 = 1 << 32;
/// Where [`lookup`]'s result keeps the TCP flag bits its walk looked at.
const TCP_MASK_SHIFT: u32 = 40;

/// What [`lookup`] returns for a prefix whose candidates name a rule id without a record (an id
/// past the rule map: never written by the agent) before one that matches: an id that is no
/// rule, which the program passes and counts as internal. (`without_l4`, for the rare packets
/// without an L4 header, still skips such an id.)
pub const MISSING_RULE: u32 = ratelimit_common::MAX_RULES;

/// The trie lookup and candidate walk: the rule id ([`NO_RULE`]: none) in the low 32 bits,
/// [`ANY_L4`] when the result holds for every protocol and port (no prefix matched, or the first
/// candidate matches any), and from [`TCP_MASK_SHIFT`] the union of the TCP flag bits of the
/// rules tried (the cache keys on those bits: see `ClassSlot`). One integer rather than a tuple:
/// simpler code for the verifier.
#[inline(always)]
fn lookup(pkt: &Packet, epoch: u32, s: *mut Scratch) -> u64 {
    // (An IPv4 source whose /16 the table decides does not come here: see `classify`.)
    let Some(set) = PREFIXES.get(prefix_key(pkt, epoch, s)) else {
        return ANY_L4 | u64::from(NO_RULE);
    };
    let len = set.len as usize;
    let mut looked: u64 = 0;
    for i in 0..MAX_CANDIDATES {
        if i >= len {
            break;
        }
        let id = set.rules[i];
        let Some(rule) = RULES.get(id) else {
            return u64::from(MISSING_RULE);
        };
        looked |= u64::from(rule.tcp_mask);
        if rule.protocol != 0 && rule.protocol != pkt.protocol {
            continue;
        }
        if rule.dst_port != 0 && pkt.dst_port != rule.dst_port {
            continue;
        }
        if pkt.tcp_flags & rule.tcp_mask != rule.tcp_flags {
            continue;
        }
        let any = i == 0 && rule.protocol == 0 && rule.dst_port == 0 && rule.tcp_mask == 0;
        return if any { ANY_L4 } else { 0 } | looked << TCP_MASK_SHIFT | u64::from(id);
    }
    looked << TCP_MASK_SHIFT | u64::from(NO_RULE)
}
