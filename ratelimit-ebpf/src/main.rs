//! The ratelimit XDP program: parse, classify by longest source prefix, charge the source's token
//! bucket, and pass or drop. Anything it cannot decide passes (fail open).
//!
//! A packet goes through, in order:
//! - `parse.rs`: Ethernet, VLANs, IPv4/IPv6 (extension headers), L4 ports, and the packet's
//!   *shape* (whole, truncated, a fragment, a chain too long to classify);
//! - `frag.rs`: fragments other than the first take their datagram's first fragment's verdict;
//! - `classify.rs`: the rule, from the IPv4 table where it decides the source's /16, else from
//!   the prefix trie (`maps.rs`) through the per-CPU classification cache (`scratch.rs`);
//! - `store.rs`: the source's bucket record in the bucket store (found, or claimed for a new
//!   source); `bucket.rs`: its GCRA charge by compare-and-swap (a cluster-scoped limit's in the
//!   time of its share, `ratelimit_common::share`, through the global function
//!   `rl_charge_cluster`);
//! - `stats.rs`: the rule's and the global counters.
//!
//! The maps and record types are shared with user space through `ratelimit-common`; this file
//! holds the entry point and the decision (`decide`).
//!
//! What the verifier and the BPF target allow (stack per call chain, instruction budget, global
//! functions, what the verifier refuses) and how the code keeps within it: CONSTRAINTS.md, in
//! this crate. Comments point there rather than repeat it.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![feature(asm_experimental_arch)]
#![expect(
    internal_features,
    reason = "core_intrinsics: the only 64-bit CAS the BPF target offers"
)]
// The bench-only build without the handling of cut packets (see Cargo.toml) leaves that code unused.
#![cfg_attr(feature = "bench-without-cut", allow(dead_code, unused_imports))]

mod bucket;
mod classify;
mod frag;
mod maps;
mod parse;
mod scratch;
mod stats;
mod store;

use aya_ebpf::{
    bindings::xdp_action, helpers::bpf_ktime_get_ns, macros::xdp, programs::XdpContext,
};
use aya_log_ebpf::debug;
use ratelimit_common::{
    action, bucket_sets, config_flags, extra_index, family, frag_flags, global, rule_flags, share,
    verdict, Bucket, Config, Rule, BUCKET_WAYS, MAX_LIMITS,
};

use crate::{
    bucket::Params,
    classify::WithoutL4,
    maps::{BUCKETS, CONFIG, RULES},
    parse::{shape, Packet, PROTOCOL_UNKNOWN},
    scratch::{
        ChargeClock, ClassSlot, Extra, GateSlot, Scratch, CLASS_SLOTS, DROP_BATCH, NO_RECORD,
        NO_RULE, SLOT_VALID,
    },
    stats::{bump_global, count_rule},
    store::{Key, Scan},
};

#[xdp]
pub fn ratelimit(ctx: XdpContext) -> u32 {
    match try_ratelimit(&ctx) {
        Ok(action) => action,
        Err(()) => {
            bump_global(global::INTERNAL);
            xdp_action::XDP_PASS
        }
    }
}

#[inline(always)]
fn try_ratelimit(ctx: &XdpContext) -> Result<u32, ()> {
    bump_global(global::PACKETS);
    let mut pkt = match parse::parse(ctx) {
        Ok(pkt) => pkt,
        Err(counter) => return Ok(unparsed(counter)),
    };
    let config = CONFIG.get_ptr(0).ok_or(())?;
    // SAFETY: a live map value; the agent writes each word whole.
    let (epoch, flags) = unsafe { ((*config).generation, (*config).flags) };
    let s = scratch::get().ok_or(())?;
    // A rarely cut packet is laundered (see `scratch::launder`), in place: a copy of the packet
    // on every packet cost several ns.
    if !cfg!(feature = "bench-without-cut") && pkt.shape != shape::WHOLE {
        scratch::launder_packet(s, &mut pkt);
    }
    let d = decide(&pkt, epoch, s);
    let what = d >> 56;
    let id = d as u32;
    if what == decision::DROP {
        bump_global(id as usize);
        return Ok(if flags & config_flags::DRY_RUN != 0 {
            xdp_action::XDP_PASS
        } else {
            xdp_action::XDP_DROP
        });
    }
    if what == decision::UNCLASSIFIED {
        return Ok(xdp_action::XDP_PASS);
    }
    let rule = match RULES.get(id) {
        Some(rule) if id != NO_RULE => rule,
        // A prefix naming a rule id without a record (`classify::MISSING_RULE`): passed,
        // counted as internal (the agent rewrites every prefix at its next install).
        _ if id != NO_RULE => return Err(()),
        _ => {
            bump_global(global::NO_MATCH);
            return Ok(xdp_action::XDP_PASS);
        }
    };
    let slot = if what == decision::CACHED {
        let i = (d >> 32) as usize & (CLASS_SLOTS - 1);
        // SAFETY: this CPU's live scratch record; `i` is in bounds.
        unsafe { &raw mut (*s).class[i] }
    } else {
        scratch::uncached_slot(s)
    };
    let len = (ctx.data_end() - ctx.data()) as u64;
    let dry_run = rule.flags & rule_flags::DRY_RUN != 0 || flags & config_flags::DRY_RUN != 0;
    let (mut v, by) = match rule.action {
        action::ALLOW => (verdict::ALLOWED, 0),
        action::DENY => (verdict::DENIED, 0),
        _ => {
            let unclaimed = what == decision::CACHED && d & classify::UNCLAIMED != 0;
            let d = limit(&pkt, id, rule, len, s, slot, config, epoch, unclaimed);
            (d & 0xff, d >> 8)
        }
    };
    let mut xdp = xdp_action::XDP_PASS;
    // A limit's drop counts under the limit even in dry run.
    let decided = v;
    if v == verdict::DROPPED_RATE || v == verdict::DROPPED_BYTES || v == verdict::DENIED {
        if dry_run {
            v = verdict::DRY_RUN;
        } else {
            xdp = xdp_action::XDP_DROP;
        }
    }
    count_rule(id, v, len, decided, by);
    if flags & config_flags::DEBUG_LOG != 0 {
        log_verdict(ctx, &pkt, id, v);
    }
    Ok(xdp)
}

/// The action for a frame the parser gave up on, for the reason `counter` (counted): passed (fail
/// open; the receiving stack discards what it cannot parse either), but a frame in more VLAN tags
/// than the parser walks, which the stack may deliver and whose source is unknown: dropped while a
/// rule that can drop is in force (see [`global::DROPPED_VLAN_CHAINS`]; passed in dry run, as the
/// other shapes' drops), else passed and counted as `bad_vlan`.
#[inline(always)]
fn unparsed(counter: usize) -> u32 {
    if counter != global::DROPPED_VLAN_CHAINS {
        bump_global(counter);
        return xdp_action::XDP_PASS;
    }
    let flags = match CONFIG.get_ptr(0) {
        // SAFETY: a live map value; the agent writes each word whole.
        Some(config) => unsafe { (*config).flags },
        None => 0,
    };
    if flags & config_flags::DROPPING_RULES == 0 {
        bump_global(global::BAD_VLAN);
        return xdp_action::XDP_PASS;
    }
    bump_global(global::DROPPED_VLAN_CHAINS);
    if flags & config_flags::DRY_RUN != 0 {
        xdp_action::XDP_PASS
    } else {
        xdp_action::XDP_DROP
    }
}

/// What decided a packet: the top byte of [`decide`]'s word.
mod decision {
    /// The rule in the low 32 bits ([`NO_RULE`](crate::scratch::NO_RULE): none), with the
    /// classification cache slot (bits 32..48) that carries its drop window and record index.
    pub const CACHED: u64 = 0;
    /// The rule in the low 32 bits, classified outside the cache.
    pub const UNCACHED: u64 = 1;
    /// Nothing could be decided (a packet the receiving stack discards anyway): passed.
    pub const UNCLASSIFIED: u64 = 2;
    /// Dropped for its shape (tiny fragment, over-long chain, conflicting fragments), counted
    /// under the global counter in the low 32 bits: a rule that looks at the protocol or port
    /// could apply and the shape would walk past it.
    pub const DROP: u64 = 3;
}

/// Classifies `pkt` by how it is cut (see `parse::shape`): whole packets and first fragments by
/// their ports, other fragments by their first fragment, packets without an L4 header only where
/// no rule could depend on it. One word (see [`decision`]): plain integers keep the verifier's
/// states few and small.
#[inline(always)]
fn decide(pkt: &Packet, epoch: u32, s: *mut Scratch) -> u64 {
    if cfg!(feature = "bench-without-cut") {
        // Bench only: every packet as a whole one (see Cargo.toml).
        return classify::classify(pkt, epoch, s);
    }
    if pkt.shape == shape::WHOLE || pkt.shape == shape::TRUNCATED {
        // Whole packets (also with the TCP/UDP header cut short: without ports).
        return classify::classify(pkt, epoch, s);
    }
    // Laundered (see `scratch::launder`): the cut paths' many constant outcomes would each be
    // verified through the rest of the program.
    scratch::launder(s, decide_cut(pkt, epoch, s))
}

/// [`decide`] for fragments and packets without an L4 header: a BPF call of its own, so the whole
/// packet's path stays compact (inlined, these paths would double the program and slow every
/// packet by several ns). Its frame and the program's fill the verifier's 512 bytes
/// (CONSTRAINTS.md, "Stack").
#[inline(never)]
fn decide_cut(pkt: &Packet, epoch: u32, s: *mut Scratch) -> u64 {
    let uncached = |id: u32| decision::UNCACHED << 56 | u64::from(id);
    let drop = |reason: usize| decision::DROP << 56 | reason as u64;
    match pkt.shape {
        shape::FIRST_FRAGMENT => {
            let d = classify::classify(pkt, epoch, s);
            match frag::remember(pkt, epoch, scratch::coarse_now(s), d as u32, None) {
                Some(reason) => drop(reason),
                None => d,
            }
        }
        shape::LATER_FRAGMENT => match frag::recall(pkt, epoch, scratch::coarse_now(s)) {
            Some(e) if e.flags & frag_flags::DROP != 0 => {
                drop((e.flags >> frag::REASON_SHIFT) as usize)
            }
            Some(e) => uncached(e.rule),
            None => {
                bump_global(global::FRAGMENTS_UNMATCHED);
                // Its datagram's rule is unknown (its first fragment comes later, or was
                // forgotten) and the kernel reassembles in any order: where a rule that looks at
                // what it hides could apply (its port or flags; for IPv6, whose later fragments
                // do not name their datagram's protocol, the protocol too), the rule without
                // ports would take the charge of a fragment that its datagram's rule never sees
                // (a datagram sent last fragment first would pay one token of its port's limit).
                // Dropped, so its datagram never completes; a first fragment that follows is
                // judged by its own ports. Nothing is remembered: a flood of such fragments
                // inserts nothing into the table and costs one trie lookup more. Elsewhere the
                // rule that takes it whatever the port is its datagram's.
                let protocol = if pkt.family == family::V4 {
                    pkt.protocol
                } else {
                    PROTOCOL_UNKNOWN
                };
                match classify::without_l4(pkt, epoch, protocol) {
                    WithoutL4::Dependent => drop(global::DROPPED_UNMATCHED_FRAGMENTS),
                    _ => classify::classify(pkt, epoch, s),
                }
            }
        },
        shape::TINY_FRAGMENT | shape::LONG_CHAIN => {
            let first = pkt.first_fragment != 0;
            let id = match classify::without_l4(pkt, epoch, PROTOCOL_UNKNOWN) {
                WithoutL4::Dependent => {
                    let reason = if pkt.shape == shape::TINY_FRAGMENT {
                        global::DROPPED_TINY_FRAGMENTS
                    } else {
                        global::DROPPED_LONG_CHAINS
                    };
                    if first {
                        frag::remember(pkt, epoch, scratch::coarse_now(s), NO_RULE, Some(reason));
                    }
                    return drop(reason);
                }
                WithoutL4::NoRule => NO_RULE,
                WithoutL4::Rule(id) => id,
            };
            if pkt.shape == shape::LONG_CHAIN {
                bump_global(global::LONG_CHAINS);
            }
            if first {
                if let Some(reason) = frag::remember(pkt, epoch, scratch::coarse_now(s), id, None) {
                    return drop(reason);
                }
            }
            uncached(id)
        }
        shape::CUT_CHAIN => match classify::without_l4(pkt, epoch, PROTOCOL_UNKNOWN) {
            WithoutL4::Dependent => decision::UNCLASSIFIED << 56,
            WithoutL4::NoRule => uncached(NO_RULE),
            WithoutL4::Rule(id) => uncached(id),
        },
        _ => classify::classify(pkt, epoch, s),
    }
}

/// Charges the packet to the buckets of its rule's limits, creating a bucket for a source (or
/// group) not seen before. Returns the verdict, and in bits 8.. the limit that dropped it.
///
/// Limits are charged in order; a packet one limit drops is refunded to the limits before it
/// (`bucket::refund`, exact), so it spends no token of any limit. The first limit's path is the
/// one-limit rule's whole path, unchanged; the others go through `extra_limits` (a record to find
/// or create through `one_limit`, a BPF call), so a one-limit rule's packet pays nothing for them.
///
/// Before any of that, and before the source's own drop window (in its classification slot,
/// which the per-rule window does not need: see `classify::claim`), a rule with a `per = "rule"`
/// packet limit ([`rule_flags::GATE`]) drops
/// the packet if that limit's one bucket is known to have no token ([`gate`]): the same verdict
/// and the same tokens as charging in order (a packet passes only with a token in every limit,
/// and a dropped one spends none), but a flood of new sources makes no bucket per source, and
/// the drop is blamed on the per-rule limit even where an earlier limit would have dropped it too.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the packet's whole context, inlined"
)]
fn limit(
    pkt: &Packet,
    id: u32,
    rule: &Rule,
    len: u64,
    s: *mut Scratch,
    slot: *mut ClassSlot,
    config: *const Config,
    epoch: u32,
    unclaimed: bool,
) -> usize {
    // The clock the agent chose for the rule (CONSTRAINTS.md, "Clocks"). On the coarse one, a
    // charge reads the precise clock where the lag could change a verdict (`bucket::clock`).
    let now = if rule.flags & rule_flags::COARSE_CLOCK != 0 {
        // Not read yet for this packet (see `ChargeClock::precise`).
        // SAFETY: this CPU's live scratch record.
        unsafe { (*s).extra.clock.precise = 0 };
        scratch::coarse_now(s)
    } else {
        // SAFETY: a helper without preconditions.
        unsafe { bpf_ktime_get_ns() }
    };
    if rule.flags & rule_flags::GATE != 0 {
        // The window itself is checked inline (a BPF call costs more than the whole check): the
        // packets of a flood under an empty aggregate, nearly all of them, stop here. Only a
        // window that is over or whose batch is spent calls `gate` to look at the bucket; no
        // window (the aggregate has tokens), no call.
        let g = gate_slot(s, id);
        // SAFETY: this CPU's live scratch record (XDP runs with preemption disabled).
        unsafe {
            let open = (*g).rule == id && (*g).epoch == epoch && (*g).flags & SLOT_VALID != 0;
            let count = (*g).drop_count;
            if open
                && count < DROP_BATCH
                && bucket::window_holds(rule.flags, now, (*g).drop_until, charge_clock(s))
            {
                (*g).drop_count = count + 1;
                let k = rule_flags::gate_limit(rule.flags);
                return verdict::DROPPED_RATE | (k as usize) << 8;
            }
            // The packet's context for the BPF calls (`gate`, and `open_gate` below): stored
            // only past the window, which drops nearly every packet of a flood.
            let c = &raw mut (*s).extra;
            (*c).id = id;
            (*c).len = len;
            (*c).now = now;
            (*c).epoch = epoch;
            if open {
                // Laundered: the call's few outcomes would each be verified through the rest.
                let d = scratch::launder(s, gate(pkt, rule) as u64) as usize;
                if d != 0 {
                    return d;
                }
            }
        }
    }
    // The source's slot, from here on (the per-rule window above needs only the rule): a
    // source classified from the IPv4 table makes it its own first (`classify::claim`).
    if unclaimed {
        classify::claim(pkt, epoch, slot, id);
    }
    // SAFETY: this CPU's classification slot for this packet (see `scratch`).
    let (drop_until, drop_count, drop_limit, cached) = unsafe {
        (
            (*slot).drop_until,
            (*slot).drop_count,
            (*slot).drop_limit,
            (*slot).bucket,
        )
    };
    if drop_count < DROP_BATCH && bucket::window_holds(rule.flags, now, drop_until, charge_clock(s))
    {
        // SAFETY: as above.
        unsafe { (*slot).drop_count = drop_count + 1 };
        return verdict::DROPPED_RATE | usize::from(drop_limit) << 8;
    }
    // SAFETY: this CPU's live scratch record; `config` a live map value. Where every charge
    // of this packet reads it (see `shares_until`).
    unsafe {
        (*s).extra.clock.shares_until =
            core::ptr::read_volatile(&raw const (*config).shares_until_ns);
    }
    // SAFETY: this CPU's live scratch record.
    let key = unsafe { &mut (*s).first_key };
    *key = store::key(pkt, id, 0, &rule.src_mask, rule.bucket_gen);
    // The drop window's end in the scratch record, where a cluster-scoped charge leaves it too:
    // not on this frame (CONSTRAINTS.md, "Stack").
    // SAFETY: this CPU's live scratch record.
    let until = unsafe { &mut (*s).extra.clock.until };
    *until = 0;
    let (v, b) = find_and_charge::<_, true>(key, rule, cached, len, now, s, slot, 0, until);
    // SAFETY: as above; and this CPU's classification slot, whose window fields the charge
    // leaves alone: read again, not kept live across its BPF call (CONSTRAINTS.md, "Stack").
    let (until, drop_count, drop_limit) = unsafe {
        (
            (*s).extra.clock.until,
            (*slot).drop_count,
            (*slot).drop_limit,
        )
    };
    if v == verdict::DROPPED_RATE || v == verdict::DROPPED_BYTES {
        bucket::count(b, false, len);
        // SAFETY: as above, and `b` is a live record (a drop always has one).
        unsafe {
            if drop_limit == 0 {
                (*b).dropped_pkts = (*b).dropped_pkts.wrapping_add(drop_count);
            }
            (*slot).drop_until = bucket::window_end(rule.flags, until, now);
            (*slot).drop_count = 0;
            (*slot).drop_limit = 0;
        }
        // Called for every rule, returning at once without a per-rule limit (CONSTRAINTS.md,
        // "Instruction budget"); once per drop window (`DROP_BATCH`), or per byte-rate drop.
        open_gate(rule, slot, v, until);
        return v;
    }
    if rule.extra_len != 0 {
        // SAFETY: this CPU's live scratch record.
        let c = unsafe { &raw mut (*s).extra };
        // SAFETY: as above.
        unsafe {
            (*c).id = id;
            (*c).drop_count = drop_count;
            (*c).len = len;
            (*c).now = now;
            (*c).until = 0;
            (*c).drop_limit = u32::from(drop_limit);
        }
        scratch::no_records(unsafe { &raw mut (*c).records });
        let d = extra_limits(pkt, rule, slot, c);
        if d != verdict::PASSED {
            // Dropped by limit `d >> 8` (> 0): the extra limits before it get their charge back
            // (each only where its record still holds its key), and the first limit's, if its
            // record still holds the key (another CPU may have recycled it meanwhile: the refund
            // would give that key a token it was not charged).
            refund_extra(pkt, rule, (d >> 8) - 1);
            // SAFETY: this CPU's live scratch record (the key `limit` built above).
            if !b.is_null() && store::holds(b, unsafe { &(*s).first_key }) {
                // SAFETY: this CPU's live scratch record (read back, not kept live across the
                // calls: CONSTRAINTS.md, "Stack").
                unsafe { bucket::refund(b, rule, len, (*c).now, &raw const (*c).clock) };
            }
            // SAFETY: as above.
            unsafe {
                (*slot).drop_until = (*c).until;
                (*slot).drop_count = 0;
                (*slot).drop_limit = (d >> 8) as u8;
            }
            // SAFETY: this CPU's live scratch record.
            // As above, for every rule.
            open_gate(rule, slot, d, unsafe { (*c).until });
            return d;
        }
    }
    if !b.is_null() {
        bucket::count(b, true, len);
        // SAFETY: as above.
        unsafe {
            if drop_limit == 0 {
                (*b).dropped_pkts = (*b).dropped_pkts.wrapping_add(drop_count);
            }
        }
    }
    // SAFETY: as above.
    unsafe {
        (*slot).drop_until = 0;
        (*slot).drop_count = 0;
    }
    v
}

/// Whether the per-rule limit `k` of `rule` (see [`rule_flags::GATE`]) drops the packet before
/// any limit is charged, once this CPU's window for the rule is over or its batch spent (`limit`
/// drops from the window itself, up to [`DROP_BATCH`] in a row): from the limit's bucket (found in
/// the record the window remembers, if it still holds the key): its TAT says whether a packet
/// would conform, as `bucket::charge` judges it, and a drop renews the window (a token closes
/// it). The verdict word of the drop (`DROPPED_RATE`, limit `k` in bits 8..), or 0: charge the
/// limits in order.
///
/// A BPF call (the packet's context in the scratch record's `Extra`) whose verdict `limit`
/// launders (CONSTRAINTS.md, "Instruction budget"), made only for a window that is over or whose
/// batch is spent (once per [`DROP_BATCH`] drops, or per token).
#[inline(never)]
fn gate(pkt: &Packet, rule: &Rule) -> usize {
    let Some(s) = scratch::get() else {
        return 0;
    };
    // SAFETY: this CPU's live scratch record, filled by the caller.
    let (id, len, now) = unsafe {
        let c = &raw const (*s).extra;
        ((*c).id, (*c).len, (*c).now)
    };
    let k = rule_flags::gate_limit(rule.flags);
    let drop = verdict::DROPPED_RATE | (k as usize) << 8;
    // The caller found the slot valid for this rule, epoch and family, and its window over or
    // its batch spent: look at the bucket.
    let g = gate_slot(s, id);
    // SAFETY: this CPU's live scratch record (XDP runs with preemption disabled).
    let (count, record) = unsafe { ((*g).drop_count, (*g).record) };
    let Some(b) = BUCKETS.get_ptr_mut(record) else {
        return 0;
    };
    let (interval, tolerance, flags) = if k == 0 {
        (rule.pkt_interval_ns, rule.pkt_tolerance_ns, rule.flags)
    } else {
        let l = &rule.extra[extra_index(k as usize)];
        (l.pkt_interval_ns, l.pkt_tolerance_ns, l.flags)
    };
    let key = store::key(pkt, id, k, &[0; 4], rule.bucket_gen);
    if !store::holds(b, &key) {
        // SAFETY: as above.
        unsafe { (*g).flags = 0 };
        return 0;
    }
    // On the precise clock, whatever the rule's: the lagging coarse one could drop a packet the
    // charge would admit (see `bucket::clock`). Once per window, not per packet.
    let now = if flags & rule_flags::COARSE_CLOCK != 0 {
        scratch::precise_now(charge_clock(s))
    } else {
        now
    };
    // SAFETY: `b` is a live record holding the limit's bucket; as above for `g`.
    unsafe {
        (*b).dropped_pkts = (*b).dropped_pkts.wrapping_add(count);
        (*g).drop_count = 0;
        let tat = core::ptr::read_volatile(&raw const (*b).tat_ns);
        // A cluster-scoped limit's TAT kept in its share's time (`ratelimit_common::share`) is
        // judged in that time, as the charge judges it: read at the whole rate it would look
        // further in debt than it is. `shares_until` is as this CPU's last charge read it: a TAT
        // of another time than the one that gives is left to the charge, in order; either time
        // reads the bucket's tokens alike. A TAT at the whole rate is judged at it: where a share
        // is in force the charge brings it into the share's time with its tokens.
        let (interval, tolerance) =
            if flags & rule_flags::CLUSTER != 0 && tat & share::STRETCHED != 0 {
                let dom = bucket::domain_of(b, flags, now, charge_clock(s));
                if !share::same_time(tat, dom) {
                    (*g).flags = 0;
                    return 0;
                }
                let cost = share::cost(interval, dom);
                (cost, share::pkt_tolerance(tolerance, interval, cost, dom))
            } else {
                (interval, tolerance)
            };
        let next = if tat > now { tat } else { now } + interval;
        if next - now > tolerance {
            bucket::count(b, false, len);
            (*g).drop_until = bucket::window_end(flags, next - tolerance, now);
            return drop;
        }
        if next + interval - now <= tolerance {
            // Tokens for this packet and the next: the window closes (charged in order until
            // the limit drops again).
            (*g).flags = 0;
        } else {
            // This packet's token only: the window stays, over, so the next packet comes back
            // here. Under a flood, that one is dropped before any limit is charged: closed, the
            // window would let it be charged to the limits before this one (a new source's
            // bucket made, then its charge given back when this limit drops it).
            (*g).drop_until = 0;
        }
    }
    0
}

/// This CPU's window slot of rule `id` (see [`GateSlot`]).
#[inline(always)]
fn gate_slot(s: *mut Scratch, id: u32) -> *mut GateSlot {
    // SAFETY: this CPU's live scratch record; the index is masked into bounds.
    unsafe { &raw mut (*s).gate[id as usize & (scratch::GATE_SLOTS - 1)] }
}

/// After a drop (verdict word `d`, the limit in bits 8..), opens this CPU's window for the rule's
/// per-rule limit (see [`gate`]) if that limit dropped the packet for its rate: its bucket is in
/// the record the slot remembers for it, without a token before `until`. The rule's id and epoch
/// are in the scratch record's `Extra` (see `limit`). A BPF call, as [`gate`]: it runs once per
/// window, not per packet.
#[inline(never)]
fn open_gate(rule: &Rule, slot: *mut ClassSlot, d: usize, until: u64) {
    let mut until = until;
    let dropper = d >> 8;
    if dropper != 0 && d & 0xff == verdict::DROPPED_RATE {
        // An extra limit dropped the packet (`limit`'s path for them set the scratch record's
        // `now` for this packet): a cluster-scoped one's window is capped here
        // (`bucket::window_end`), off the full frames (CONSTRAINTS.md, "Stack").
        if let Some(s) = scratch::get() {
            // SAFETY: this CPU's live scratch record and classification slot.
            unsafe {
                let flags = rule.extra[extra_index(dropper)].flags;
                until = bucket::window_end(flags, until, (*s).extra.now);
                (*slot).drop_until = until;
            }
        }
    }
    let k = rule_flags::gate_limit(rule.flags) as usize;
    if rule.flags & rule_flags::GATE == 0 || d & 0xff != verdict::DROPPED_RATE || d >> 8 != k {
        return;
    }
    // SAFETY: this CPU's classification slot; the index is masked into bounds.
    let record = unsafe {
        if k == 0 {
            (*slot).bucket
        } else {
            (*slot).extra[extra_index(k)]
        }
    };
    if record == NO_RECORD {
        return;
    }
    let Some(s) = scratch::get() else {
        return;
    };
    // SAFETY: this CPU's live scratch record.
    let (id, epoch, now) = unsafe { ((*s).extra.id, (*s).extra.epoch, (*s).extra.now) };
    let flags = if k == 0 {
        rule.flags
    } else {
        rule.extra[extra_index(k)].flags
    };
    let until = bucket::window_end(flags, until, now);
    let g = gate_slot(s, id);
    // SAFETY: as above.
    unsafe {
        (*g).epoch = epoch;
        (*g).rule = id;
        (*g).flags = SLOT_VALID;
        (*g).record = record;
        (*g).drop_until = until;
        (*g).drop_count = 0;
    }
}

/// Charges the packet to the rule's limits after its first, in order: `PASSED` (counted in each
/// of their buckets), or a drop (with the limit in bits 8..), after which the caller gives the
/// limits before the dropping one their charge back (`refund_extra`, and the first's).
#[inline(always)]
fn extra_limits(pkt: &Packet, rule: &Rule, slot: *mut ClassSlot, c: *mut Extra) -> usize {
    let n = rule.extra_len as usize;
    for k in 0..MAX_LIMITS - 1 {
        if k >= n {
            break;
        }
        // A known source's record, remembered in its slot, is charged here (inlined): a BPF
        // call costs more than the charge (CONSTRAINTS.md, "Shape"), so only a record to find or
        // create pays it.
        let v = match cached_limit(pkt, rule, slot, c, k) {
            Some(v) => v,
            // SAFETY: the live packet, rule and slot of this packet.
            None => unsafe { one_limit(pkt, rule, slot, k) },
        };
        if v == verdict::DROPPED_RATE || v == verdict::DROPPED_BYTES {
            // The limits before this one get their charge back from the caller
            // (`refund_extra`, and the first's).
            return v | (k + 1) << 8;
        }
    }
    for j in 0..MAX_LIMITS - 1 {
        if j >= n {
            break;
        }
        // SAFETY: as above.
        if let Some(r) = BUCKETS.get_ptr_mut(unsafe { (*c).records[j] }) {
            bucket::count(r, true, unsafe { (*c).len });
        }
    }
    verdict::PASSED
}

/// Gives the extra limits before limit `k + 1` of `rule` (`rule.extra[..k]`, charged for this
/// packet, whose records `extra_limits` left in the scratch record's `Extra::records`) their
/// charge back, each only to a record that still holds its key, as `limit` does for the first:
/// another CPU (or this packet's own later limit, creating its bucket) may have recycled it
/// meanwhile, and the refund would give that key a token it was not charged. A BPF call of its
/// own (once per drop), from `limit` after `extra_limits` returns, where the chain has room
/// (CONSTRAINTS.md, "Stack").
#[inline(never)]
fn refund_extra(pkt: &Packet, rule: &Rule, k: usize) {
    let Some(s) = scratch::get() else {
        return;
    };
    // SAFETY: this CPU's live scratch record (only the address is taken).
    let c = unsafe { &raw mut (*s).extra };
    for j in 0..MAX_LIMITS - 1 {
        if j >= k {
            break;
        }
        // SAFETY: this CPU's live scratch record; `j` is in bounds.
        if let Some(r) = BUCKETS.get_ptr_mut(unsafe { (*c).records[j] }) {
            // The key in the scratch record, not on this frame.
            // SAFETY: this CPU's live scratch record.
            let key = unsafe { &mut (*s).extra_key };
            *key = store::key(
                pkt,
                // SAFETY: as above.
                unsafe { (*c).id },
                j as u32 + 1,
                &rule.extra[j].src_mask,
                rule.bucket_gen,
            );
            if store::holds(r, key) {
                bucket::refund(
                    r,
                    &rule.extra[j],
                    // SAFETY: as above.
                    unsafe { (*c).len },
                    unsafe { (*c).now },
                    unsafe { &raw const (*c).clock },
                );
            }
        }
    }
}

/// Charges the packet to limit `k + 1` of `rule` (`rule.extra[k]`): the verdict; the record is
/// left in the scratch record's `Extra::records[k]`, the drop window's end in `Extra::until`.
/// Not inlined (a BPF call, with the packet's context in the scratch record): a one-limit rule's
/// packet pays nothing for it, and its stack is its own (inlined three times, it would take the
/// program's frame past what the verifier allows beside `decide_cut`'s).
///
/// A *global* BPF function, verified once on its own (CONSTRAINTS.md, "Global functions"); the
/// chain through it to `store::other_holder` is at the verifier's 512 bytes ("Stack").
///
/// # Safety
/// `pkt`, `rule` and `slot` are null or point at a live packet, rule and classification slot.
#[inline(never)]
#[no_mangle]
pub unsafe extern "C" fn one_limit(
    pkt: *const Packet,
    rule: *const Rule,
    slot: *mut ClassSlot,
    k: usize,
) -> usize {
    if pkt.is_null() || rule.is_null() || slot.is_null() {
        return verdict::NO_BUCKET;
    }
    // SAFETY: checked non-null above; the caller's live packet and rule.
    let (pkt, rule) = unsafe { (&*pkt, &*rule) };
    let Some(s) = scratch::get() else {
        return verdict::NO_BUCKET;
    };
    if k >= MAX_LIMITS - 1 {
        return verdict::NO_BUCKET;
    }
    // SAFETY: this CPU's live scratch record, filled by the caller.
    let c = unsafe { &mut (*s).extra };
    let l = &rule.extra[k];
    let limit = k as u32 + 1;
    // SAFETY: this CPU's live scratch record.
    let key = unsafe { &mut (*s).extra_key };
    *key = store::key(pkt, c.id, limit, &l.src_mask, rule.bucket_gen);
    // SAFETY: this CPU's classification slot; `k` is in bounds.
    let cached = unsafe { (*slot).extra[k] };
    let (len, now) = (c.len, c.now);
    // SAFETY: this CPU's live scratch record: the window's end lands there, not on this frame.
    let until = unsafe { &mut (*s).extra_until };
    *until = 0;
    // The cluster-scoped charge inline (`bucket::charge`): a BPF call from here would stack its
    // frame on this one's and the program's, past the verifier's 512 bytes.
    let (v, b) = find_and_charge::<_, false>(key, l, cached, len, now, s, slot, limit, until);
    let until = *until;
    if b.is_null() {
        c.records[k] = NO_RECORD;
        return v;
    }
    // SAFETY: this CPU's classification slot; `k` is in bounds.
    let record = unsafe { (*slot).extra[k] };
    settle(b, v, until, c, k, record)
}

/// `one_limit`'s charge through the record the slot remembers for limit `k + 1` of `rule`, if
/// that record still holds the source's key: the verdict, or `None` (the record is to be found,
/// or created, by `one_limit`). Inlined: no BPF call for a known source.
#[inline(always)]
fn cached_limit(
    pkt: &Packet,
    rule: &Rule,
    slot: *mut ClassSlot,
    c: *mut Extra,
    k: usize,
) -> Option<usize> {
    if k >= MAX_LIMITS - 1 {
        return None;
    }
    // SAFETY: this CPU's classification slot; `k` is in bounds.
    let cached = unsafe { (*slot).extra[k] };
    if cached == NO_RECORD {
        return None;
    }
    let r = BUCKETS.get_ptr_mut(cached)?;
    let l = &rule.extra[k];
    // SAFETY: this CPU's live scratch record, filled by the caller.
    let c = unsafe { &mut *c };
    let key = store::key(pkt, c.id, k as u32 + 1, &l.src_mask, rule.bucket_gen);
    if !store::holds(r, &key) {
        return None;
    }
    // The window's end in the scratch record, where a cluster-scoped charge leaves it too: not
    // on the program's frame (CONSTRAINTS.md, "Stack").
    c.until = 0;
    let v = bucket::charge::<_, true>(r, l, c.now, c.len, &mut c.until, &raw mut c.clock);
    let until = c.until;
    Some(settle(r, v, until, c, k, cached))
}

/// What a charge of limit `k + 1` (verdict `v`, record `b` at index `record`) leaves behind: the
/// slot window's drops added to its counter if it was this limit's, the packet counted if
/// dropped (with the window's end in `c.until`), the record in `c.records[k]` if not.
#[inline(always)]
fn settle(b: *mut Bucket, v: usize, until: u64, c: &mut Extra, k: usize, record: u32) -> usize {
    // SAFETY: `b` is a live record.
    unsafe {
        if c.drop_limit == k as u32 + 1 {
            (*b).dropped_pkts = (*b).dropped_pkts.wrapping_add(c.drop_count);
        }
    }
    if k >= MAX_LIMITS - 1 {
        return v;
    }
    if v == verdict::DROPPED_RATE || v == verdict::DROPPED_BYTES {
        bucket::count(b, false, c.len);
        c.until = until;
        c.records[k] = NO_RECORD;
    } else {
        c.records[k] = record;
    }
    v
}

/// Finds (or creates) the bucket of `key`, limit `limit` of its rule with parameters `p`, and
/// charges the packet to it: the verdict and the record (null if there is none: `NO_BUCKET`,
/// fail open). The record found is remembered in the slot. On `DROPPED_RATE`, `*until` is the
/// end of the drop window.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the packet's whole context, inlined"
)]
fn find_and_charge<P: Params, const CALL: bool>(
    key: &Key,
    p: &P,
    cached: u32,
    len: u64,
    now: u64,
    s: *mut Scratch,
    slot: *mut ClassSlot,
    limit: u32,
    until: &mut u64,
) -> (usize, *mut Bucket) {
    // One charge for both ways of finding a known source's record: every copy of a cluster-
    // scoped charge's BPF call costs the frame what it keeps across it (CONSTRAINTS.md, "Stack").
    let r = 'found: {
        // The record this CPU found for the source last time, if it still holds the key.
        if cached != NO_RECORD {
            if let Some(r) = BUCKETS.get_ptr_mut(cached) {
                if store::holds(r, key) {
                    break 'found r;
                }
            }
        }
        // Looked up here, on the path that needs it, rather than passed in and kept live across
        // the charge (CONSTRAINTS.md, "Stack").
        let Some(config) = CONFIG.get_ptr(0) else {
            return (no_bucket(), core::ptr::null_mut());
        };
        // SAFETY: a live map value, written whole by the agent before it attaches.
        let (seed, sets) = unsafe { ((*config).seed, (*config).bucket_sets) };
        if sets == 0 {
            return (no_bucket(), core::ptr::null_mut());
        }
        let sets = bucket_sets(
            // The key's family, not the packet's: a per-rule key is one for both.
            ratelimit_common::bucket_hash(
                seed,
                key.header as u32 & 0xffff,
                (key.header >> 16) as u8,
                key.addr,
            ),
            sets,
        );
        match store::scan(key, sets, scratch::coarse_now(s), s) {
            Scan::Hit(i, r) => {
                remember(slot, limit, i);
                r
            }
            Scan::Miss {
                victim,
                header,
                kind,
            } => {
                let now = bucket::new_bucket_now(p, now, charge_clock(s));
                return create(p, len, now, key, sets, victim, header, kind, slot, limit);
            }
            Scan::None => return (no_bucket(), core::ptr::null_mut()),
        }
    };
    (
        bucket::charge::<_, CALL>(r, p, now, len, until, charge_clock(s)),
        r,
    )
}

/// Remembers in the slot that limit `limit`'s bucket is in record `i`.
#[inline(always)]
fn remember(slot: *mut ClassSlot, limit: u32, i: u32) {
    // SAFETY: this CPU's classification slot; the index is checked in bounds.
    unsafe {
        if limit == 0 {
            (*slot).bucket = i;
        } else if (limit as usize) < MAX_LIMITS {
            (*slot).extra[limit as usize - 1] = i;
        }
    }
}

/// A new bucket for `key` (a full one, charged for this packet) in record `victim` of its set.
/// The packet is counted in it only if dropped (the caller counts a pass, once every limit
/// passed it).
///
/// Two CPUs can create the same key's bucket at the same instant (the key's first packets on two
/// queues), each in a record of its own: a source must never hold two buckets (two bursts). So
/// once its record is published, a creator looks for another record holding the key and, if one
/// does, gives its own back and charges that one instead. Of two creators, the one that
/// published later always sees the other's record (its look comes after both publications), so
/// at most one record survives (if both see each other, both give theirs back, and the key's
/// next packet creates its bucket anew). The packet of a creator that gives its record back
/// passes uncharged (`bucket_errors`), as one that loses the claim of a record does: at most one
/// packet per CPU per such race. The record taken is evicted either way: counted.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the packet's whole context, inlined"
)]
fn create<P: Params>(
    p: &P,
    len: u64,
    now: u64,
    key: &Key,
    sets: [u32; 2],
    victim: u32,
    header: u64,
    kind: u64,
    slot: *mut ClassSlot,
    limit: u32,
) -> (usize, *mut Bucket) {
    let (v, tat, byte_tat) = bucket::charge_new(p, now, len);
    let Some(b) = store::install(
        victim,
        header,
        key,
        (tat, byte_tat, Bucket::created_at(now)),
    ) else {
        // Another CPU took the record in the same instant: this one packet passes uncharged
        // by this limit (fail open), counted.
        return (no_bucket(), core::ptr::null_mut());
    };
    if let Some(c) = store::eviction_counter(kind) {
        bump_global(c);
    }
    let other = store::other_holder(key, sets[0] * BUCKET_WAYS, sets[1] * BUCKET_WAYS, victim);
    if other != NO_RECORD {
        // Another CPU (or the agent) created the key's bucket at the same time: this one goes,
        // and the packet, already counted against the bucket given back, passes uncharged
        // (counted). Given back whatever `release` says: if it failed, the agent took it out
        // first (it keeps its own and folds this one in), and it is not this packet's any more.
        let _ = store::release(b, key);
        remember(slot, limit, other);
        return (no_bucket(), core::ptr::null_mut());
    }
    bump_global(global::NEW_BUCKETS);
    remember(slot, limit, victim);
    (v, b)
}

/// What the packet's charges read of the clocks (`scratch::ChargeClock`): `Config::shares_until_ns`
/// (until when the cluster shares in the buckets hold) as `limit` copied it to this CPU's scratch
/// record for this packet, and the precise clock once read. The scratch pointer is live wherever
/// a bucket is charged, the config's not (kept live, it cost a stack slot).
#[inline(always)]
fn charge_clock(s: *mut Scratch) -> *mut ChargeClock {
    // SAFETY: this CPU's live scratch record (only the address is taken).
    unsafe { &raw mut (*s).extra.clock }
}

#[inline(always)]
fn no_bucket() -> usize {
    bump_global(global::BUCKET_ERRORS);
    verdict::NO_BUCKET
}

#[inline(never)]
fn log_verdict(ctx: &XdpContext, pkt: &Packet, id: u32, v: usize) {
    if pkt.family == family::V4 {
        debug!(
            ctx,
            "src {:i} proto {} rule {} verdict {}",
            u32::from_be(pkt.src[0]),
            pkt.protocol,
            id,
            v
        );
    } else {
        // SAFETY: same size, any bit pattern valid.
        let src: [u8; 16] = unsafe { core::mem::transmute(pkt.src) };
        debug!(
            ctx,
            "src {:i} proto {} rule {} verdict {}", src, pkt.protocol, id, v
        );
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

/// Benchmark reference: passes everything (the floor a limiter's cost is measured against).
/// Never attached by the agent.
#[xdp]
pub fn bench_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// Benchmark reference: drops everything (the end-to-end floor on a receiving veth).
#[xdp]
pub fn bench_drop(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_DROP
}

/// Benchmark traffic generator: with BPF_PROG_TEST_RUN in live-frames mode and `ingress_ifindex`
/// set to a veth, XDP_TX sends each frame to the veth's peer.
#[xdp]
pub fn bench_tx(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_TX
}
