//! The ratelimit XDP program: parse, classify by longest source prefix, charge the source's token
//! bucket, and pass or drop. Anything it cannot decide passes (fail open).
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![expect(
    internal_features,
    reason = "core_intrinsics: the only 64-bit CAS the BPF target offers"
)]

mod bucket;
mod classify;
mod maps;
mod parse;
mod scratch;
mod stats;

use aya_ebpf::{
    bindings::{xdp_action, BPF_NOEXIST},
    helpers::bpf_ktime_get_ns,
    macros::xdp,
    programs::XdpContext,
};
use aya_log_ebpf::debug;
use ratelimit_common::{
    action, config_flags, family, first_seen_hash, global, rule_flags, verdict, Bucket, BucketKey,
    FirstSeen, Rule, FIRST_SEEN_SLOTS,
};

use crate::{
    maps::{BUCKETS, CONFIG, FIRST_SEEN},
    parse::Packet,
    scratch::{ClassSlot, Scratch, DROP_BATCH},
    stats::{bump_global, count_rule},
};

const EEXIST: i32 = 17;

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
    let pkt = match parse::parse(ctx) {
        Ok(pkt) => pkt,
        Err(counter) => {
            bump_global(counter);
            return Ok(xdp_action::XDP_PASS);
        }
    };
    let config = *CONFIG.get(0).ok_or(())?;
    let s = scratch::get().ok_or(())?;
    let Some((id, rule, slot)) = classify::classify(&pkt, config.generation, s) else {
        bump_global(global::NO_MATCH);
        return Ok(xdp_action::XDP_PASS);
    };
    let len = (ctx.data_end() - ctx.data()) as u64;
    let dry_run =
        rule.flags & rule_flags::DRY_RUN != 0 || config.flags & config_flags::DRY_RUN != 0;
    let mut v = match rule.action {
        action::ALLOW => verdict::ALLOWED,
        action::DENY => verdict::DENIED,
        _ => limit(&pkt, id, rule, len, s, slot),
    };
    let mut xdp = xdp_action::XDP_PASS;
    if v == verdict::DROPPED_RATE || v == verdict::DROPPED_BYTES || v == verdict::DENIED {
        if dry_run {
            v = verdict::DRY_RUN;
        } else {
            xdp = xdp_action::XDP_DROP;
        }
    }
    count_rule(id, v, len);
    if config.flags & config_flags::DEBUG_LOG != 0 {
        log_verdict(ctx, &pkt, id, v);
    }
    Ok(xdp)
}

/// Charges the packet to its bucket, creating the bucket for a source not seen before.
#[inline(always)]
fn limit(
    pkt: &Packet,
    id: u32,
    rule: &Rule,
    len: u64,
    s: *mut Scratch,
    slot: *mut ClassSlot,
) -> usize {
    let masked = [
        pkt.src[0] & rule.src_mask[0],
        pkt.src[1] & rule.src_mask[1],
        pkt.src[2] & rule.src_mask[2],
        pkt.src[3] & rule.src_mask[3],
    ];
    // SAFETY: [u32; 4] and [u8; 16] have the same size and any bit pattern is valid for both.
    let addr: [u8; 16] = unsafe { core::mem::transmute(masked) };
    let key = BucketKey {
        rule: id,
        family: pkt.family,
        _pad: [0; 3],
        addr,
    };
    // The coarse clock, cached per jiffy, costs next to nothing (ktime_get_ns about 30 ns); the
    // agent picks it only for buckets whose tolerance spans several jiffies, where a tick-old
    // `now` changes nothing measurable.
    let now = if rule.flags & rule_flags::COARSE_CLOCK != 0 {
        scratch::coarse_now(s)
    } else {
        // SAFETY: a helper without preconditions.
        unsafe { bpf_ktime_get_ns() }
    };
    // SAFETY: this CPU's classification slot for this packet (see `scratch`).
    let (drop_until, drop_count) = unsafe { ((*slot).drop_until, (*slot).drop_count) };
    if now < drop_until && drop_count < DROP_BATCH {
        // SAFETY: as above.
        unsafe { (*slot).drop_count = drop_count + 1 };
        return verdict::DROPPED_RATE;
    }
    if let Some(b) = BUCKETS.get_ptr_mut(key) {
        let mut until = 0;
        let v = bucket::charge(b, rule, now, len, &mut until);
        bucket::count(b, v == verdict::PASSED, len);
        // SAFETY: as above, and `b` is a live map value.
        unsafe {
            (*b).dropped_pkts += u64::from(drop_count);
            (*slot).drop_until = until;
            (*slot).drop_count = 0;
        }
        return v;
    }
    // Not tracked: first packet, or the second one (see `FirstSeen`).
    let hash = first_seen_hash(&key);
    let Some(slot) = FIRST_SEEN.get_ptr_mut(hash & (FIRST_SEEN_SLOTS - 1)) else {
        return no_bucket();
    };
    // SAFETY: a live map value. Shared by all CPUs: two CPUs handling one source's first packets
    // at the same instant may both treat theirs as the first (one packet uncharged); a torn read
    // of a slot being rewritten at worst does the same.
    let seen = unsafe { *slot };
    let mut fresh = Bucket {
        created_ns: now,
        ..Bucket::default()
    };
    if seen.fingerprint != hash || seen.time_ns == 0 || seen.time_ns > now {
        let v = bucket::charge_local(&mut fresh, rule, now, len);
        if v == verdict::PASSED {
            // SAFETY: as above.
            unsafe {
                *slot = FirstSeen {
                    fingerprint: hash,
                    len: len as u32,
                    time_ns: now,
                }
            };
        }
        return v;
    }
    // SAFETY: as above.
    unsafe { *slot = FirstSeen::default() };
    // The bucket as it would be had it been created for the first packet, then this one.
    fresh.created_ns = seen.time_ns;
    let first = bucket::charge_local(&mut fresh, rule, seen.time_ns, u64::from(seen.len));
    bucket::count(
        &raw mut fresh,
        first == verdict::PASSED,
        u64::from(seen.len),
    );
    let v = bucket::charge_local(&mut fresh, rule, now, len);
    bucket::count(&raw mut fresh, v == verdict::PASSED, len);
    match BUCKETS.insert(key, fresh, u64::from(BPF_NOEXIST)) {
        Ok(()) => {
            bump_global(global::NEW_BUCKETS);
            v
        }
        // Another CPU created it between our lookup and insert: charge that one.
        Err(e) if e == -EEXIST => match BUCKETS.get_ptr_mut(key) {
            Some(b) => {
                let v = bucket::charge(b, rule, now, len, &mut 0);
                bucket::count(b, v == verdict::PASSED, len);
                v
            }
            None => no_bucket(),
        },
        Err(_) => no_bucket(),
    }
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
