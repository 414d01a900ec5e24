//! The ratelimit XDP program: parse, classify by longest source prefix, charge the source's token
//! bucket, and pass or drop. Anything it cannot decide passes (fail open).
//!
//! A packet goes through, in order:
//! - `parse.rs`: Ethernet, VLANs, IPv4/IPv6 (extension headers), L4 ports, and the packet's
//!   *shape* (whole, truncated, a fragment, a chain too long to classify);
//! - `frag.rs`: fragments other than the first take their datagram's first fragment's verdict;
//! - `classify.rs`: the rule, from the IPv4 table where it decides the source's /16, else from
//!   the prefix trie (`maps.rs`) through the per-CPU classification cache (`scratch.rs`);
//! - `limit.rs`: the rule's limits, charged in order (a drop gives the ones before it their
//!   charge back), behind `gate.rs`: a per-rule limit's drop window, which drops a flood's packet
//!   before any charge; `find.rs`: a limit's bucket record, found (through the classification
//!   slot, or in the store) or created, and charged;
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
mod find;
mod first;
mod frag;
mod gate;
mod limit;
mod maps;
mod parse;
mod scratch;
mod stats;
mod store;
mod tags;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use aya_log_ebpf::debug;
use ratelimit_common::{action, config_flags, family, frag_flags, global, rule_flags, verdict};

use crate::{
    classify::WithoutL4,
    limit::limit,
    maps::{CONFIG, RULES},
    parse::{shape, Packet, PROTOCOL_UNKNOWN},
    scratch::{Scratch, CLASS_SLOTS, NO_RULE},
    stats::{bump_global, count_rule},
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
/// packet by several ns). Its frame counts on the program's chain (CONSTRAINTS.md, "Stack").
#[inline(never)]
fn decide_cut(pkt: &Packet, epoch: u32, s: *mut Scratch) -> u64 {
    let uncached = |id: u32| decision::UNCACHED << 56 | u64::from(id);
    let drop = |reason: usize| decision::DROP << 56 | reason as u64;
    match pkt.shape {
        shape::FIRST_FRAGMENT => {
            let d = classify::classify(pkt, epoch, s);
            match frag::remember(pkt, epoch, scratch::coarse_now(s), d as u32, None, s) {
                Some(reason) => drop(reason),
                None => d,
            }
        }
        shape::LATER_FRAGMENT => match frag::recall(pkt, epoch, scratch::coarse_now(s), s) {
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
                match classify::without_l4(pkt, epoch, protocol, s) {
                    WithoutL4::Dependent => drop(global::DROPPED_UNMATCHED_FRAGMENTS),
                    _ => classify::classify(pkt, epoch, s),
                }
            }
        },
        shape::TINY_FRAGMENT | shape::LONG_CHAIN => {
            let first = pkt.first_fragment != 0;
            let id = match classify::without_l4(pkt, epoch, PROTOCOL_UNKNOWN, s) {
                WithoutL4::Dependent => {
                    let reason = if pkt.shape == shape::TINY_FRAGMENT {
                        global::DROPPED_TINY_FRAGMENTS
                    } else {
                        global::DROPPED_LONG_CHAINS
                    };
                    if first {
                        frag::remember(
                            pkt,
                            epoch,
                            scratch::coarse_now(s),
                            NO_RULE,
                            Some(reason),
                            s,
                        );
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
                if let Some(reason) =
                    frag::remember(pkt, epoch, scratch::coarse_now(s), id, None, s)
                {
                    return drop(reason);
                }
            }
            uncached(id)
        }
        shape::CUT_CHAIN => match classify::without_l4(pkt, epoch, PROTOCOL_UNKNOWN, s) {
            WithoutL4::Dependent => decision::UNCLASSIFIED << 56,
            WithoutL4::NoRule => uncached(NO_RULE),
            WithoutL4::Rule(id) => uncached(id),
        },
        _ => classify::classify(pkt, epoch, s),
    }
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
