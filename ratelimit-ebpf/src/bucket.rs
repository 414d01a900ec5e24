//! GCRA token buckets, exact when several CPUs charge the same bucket at once.
//!
//! A bucket is a theoretical arrival time (TAT) per limit. A packet of cost `c` conforms when
//! `max(tat, now) + c - now <= tolerance`; it then moves `tat` to `max(tat, now) + c` with a
//! compare-and-swap, so two CPUs never both spend the same token.

use core::intrinsics::{atomic_cxchg, atomic_xadd, atomic_xsub, AtomicOrdering};

use ratelimit_common::{byte_cost_ns, global, rule_flags, verdict, Bucket, Limit, Rule};

/// The parameters of one limit: a rule's first (its own fields) or one of its `extra` limits.
/// A trait rather than a copy into one form, so the first limit's path reads the rule's fields
/// in place, as it did before rules had several limits.
pub trait Params {
    fn flags(&self) -> u32;
    fn pkt_interval_ns(&self) -> u64;
    fn pkt_tolerance_ns(&self) -> u64;
    fn byte_interval_fp(&self) -> u64;
    fn byte_tolerance_ns(&self) -> u64;
}

macro_rules! params {
    ($t:ty) => {
        impl Params for $t {
            #[inline(always)]
            fn flags(&self) -> u32 {
                self.flags
            }
            #[inline(always)]
            fn pkt_interval_ns(&self) -> u64 {
                self.pkt_interval_ns
            }
            #[inline(always)]
            fn pkt_tolerance_ns(&self) -> u64 {
                self.pkt_tolerance_ns
            }
            #[inline(always)]
            fn byte_interval_fp(&self) -> u64 {
                self.byte_interval_fp
            }
            #[inline(always)]
            fn byte_tolerance_ns(&self) -> u64 {
                self.byte_tolerance_ns
            }
        }
    };
}
params!(Rule);
params!(Limit);

/// CAS attempts before the fetch-and-add fallback in [`gcra`]. Each failure means another CPU
/// made progress on this bucket, so a handful covers any realistic contention; the verifier needs
/// a bound (an unbounded loop is rejected as "too complex"). One with the test-only feature
/// `test-cas-once`, so that a test on 2 CPUs drives the fallback (see Cargo.toml).
const CAS_RETRIES: usize = if cfg!(feature = "test-cas-once") {
    1
} else {
    8
};

/// Result of charging one limit.
#[derive(PartialEq, Eq, Clone, Copy)]
enum Charge {
    Conforms,
    /// Does not conform, nor will any packet of this cost before `until` (the TAT only grows).
    Exceeds {
        until: u64,
    },
}

/// Charges `cost` to the TAT at `tat`, if the packet conforms.
#[inline(always)]
fn gcra(tat: *mut u64, now: u64, cost: u64, tolerance: u64) -> Charge {
    for _ in 0..CAS_RETRIES {
        // A plain volatile read: LLVM's BPF backend cannot select an atomic load for v3 (see
        // TOOLCHAIN.md); the CAS below validates what we read.
        // SAFETY: `tat` points into a map value that outlives this program run.
        let old = unsafe { core::ptr::read_volatile(tat) };
        let base = if old > now { old } else { now };
        let new = base + cost;
        if new - now > tolerance {
            return Charge::Exceeds {
                until: new - tolerance,
            };
        }
        // SAFETY: as above; 8-byte aligned (field of a #[repr(C)] u64 struct).
        let (_, ok) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
                tat, old, new,
            )
        };
        if ok {
            return Charge::Conforms;
        }
    }
    // Still contended after every retry (other CPUs, or the agent's cluster charge, keep moving
    // this TAT). One atomic fetch-and-add cannot fail: when the TAT it added to was not behind
    // `now` (the bucket not full), `old + cost` is exactly the step the CAS would have made, so
    // the packet is judged as it would have been. Otherwise (a full bucket, whose TAT the add did
    // not lift to `now`; or a packet that does not conform) the charge is taken back and the
    // packet dropped: under contention a packet may be dropped that would have fitted, never
    // admitted beyond `burst + rate x t`. No drop window (`until` 0): the refunds of other CPUs
    // may lower the TAT below what this CPU saw.
    crate::stats::bump_global(global::CONTENDED_FALLBACKS);
    // SAFETY: as above.
    let old = unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(tat, cost) };
    if old >= now && old + cost - now <= tolerance {
        return Charge::Conforms;
    }
    // SAFETY: as above.
    unsafe { atomic_xsub::<u64, u64, { AtomicOrdering::Relaxed }>(tat, cost) };
    Charge::Exceeds { until: 0 }
}

/// Charges a packet of `len` bytes to `bucket` under `rule` and returns its [`verdict`]
/// (`PASSED`, `DROPPED_RATE` or `DROPPED_BYTES`). On `DROPPED_RATE`, `*drop_until` is the time
/// before which every packet under this bucket would be dropped for its rate too.
#[inline(always)]
pub fn charge<P: Params>(
    bucket: *mut Bucket,
    rule: &P,
    now: u64,
    len: u64,
    drop_until: &mut u64,
) -> usize {
    // SAFETY: `bucket` points at a live map value; only addresses of fields are taken here.
    let (tat, byte_tat) = unsafe { (&raw mut (*bucket).tat_ns, &raw mut (*bucket).byte_tat_ns) };
    let limits_pkts = rule.flags() & rule_flags::PKT_LIMIT != 0;
    if limits_pkts {
        if let Charge::Exceeds { until } =
            gcra(tat, now, rule.pkt_interval_ns(), rule.pkt_tolerance_ns())
        {
            *drop_until = until;
            return verdict::DROPPED_RATE;
        }
    }
    if rule.flags() & rule_flags::BYTE_LIMIT != 0 {
        let cost = byte_cost_ns(len, rule.byte_interval_fp());
        if gcra(byte_tat, now, cost, rule.byte_tolerance_ns()) != Charge::Conforms {
            if limits_pkts {
                // The packet was charged a packet token above but is dropped: give it back.
                // SAFETY: as in gcra.
                unsafe {
                    atomic_xsub::<u64, u64, { AtomicOrdering::Relaxed }>(
                        tat,
                        rule.pkt_interval_ns(),
                    )
                };
            }
            return verdict::DROPPED_BYTES;
        }
    }
    verdict::PASSED
}

/// [`charge`] for a bucket no other CPU can see (not yet in the map), so without atomics. On a
/// default bucket (TATs zero) this is a new source's full bucket.
#[inline(always)]
pub fn charge_local<P: Params>(bucket: &mut Bucket, rule: &P, now: u64, len: u64) -> usize {
    let old_tat = bucket.tat_ns;
    if rule.flags() & rule_flags::PKT_LIMIT != 0 {
        let new = if old_tat > now { old_tat } else { now } + rule.pkt_interval_ns();
        if new - now > rule.pkt_tolerance_ns() {
            return verdict::DROPPED_RATE;
        }
        bucket.tat_ns = new;
    }
    if rule.flags() & rule_flags::BYTE_LIMIT != 0 {
        let cost = byte_cost_ns(len, rule.byte_interval_fp());
        let old = bucket.byte_tat_ns;
        let new = if old > now { old } else { now } + cost;
        if new - now > rule.byte_tolerance_ns() {
            bucket.tat_ns = old_tat;
            return verdict::DROPPED_BYTES;
        }
        bucket.byte_tat_ns = new;
    }
    verdict::PASSED
}

/// Gives back what [`charge`] took from `bucket` for a packet of `len` bytes that conformed to
/// it but that a later limit of its rule dropped: the packet spends no token of this limit.
///
/// Exact: the charge moved the TAT from `old` to `max(old, now) + cost`; taking `cost` back
/// leaves `max(old, now)`, which is `old` or a full bucket, the same thing to every later packet.
/// Other CPUs' charges in between commute with it (atomic adds). The only effect the charge has
/// is while it stands: a packet of the same bucket judged on another CPU in those few
/// nanoseconds sees one packet's cost more (and may be dropped where it would have fitted).
#[inline(always)]
pub fn refund<P: Params>(bucket: *mut Bucket, rule: &P, len: u64) {
    // SAFETY: `bucket` points at a live map value; atomic subtractions of its TAT words.
    unsafe {
        if rule.flags() & rule_flags::PKT_LIMIT != 0 {
            atomic_xsub::<u64, u64, { AtomicOrdering::Relaxed }>(
                &raw mut (*bucket).tat_ns,
                rule.pkt_interval_ns(),
            );
        }
        if rule.flags() & rule_flags::BYTE_LIMIT != 0 {
            atomic_xsub::<u64, u64, { AtomicOrdering::Relaxed }>(
                &raw mut (*bucket).byte_tat_ns,
                byte_cost_ns(len, rule.byte_interval_fp()),
            );
        }
    }
}

/// Counts the packet in the bucket's own counters (read by `top` and the cluster sync).
///
/// Plain read-modify-write, not atomic adds: these are statistics, an atomic add costs a full
/// barrier per packet, and an increment is lost only when two CPUs update the same bucket in the
/// same few nanoseconds. The admission decision itself (the TAT) is always exact.
#[inline(always)]
pub fn count(bucket: *mut Bucket, passed: bool, len: u64) {
    // SAFETY: `bucket` points at a live map value.
    unsafe {
        if passed {
            (*bucket).passed_pkts = (*bucket).passed_pkts.wrapping_add(1);
            (*bucket).passed_bytes += len;
        } else {
            (*bucket).dropped_pkts = (*bucket).dropped_pkts.wrapping_add(1);
        }
    }
}
