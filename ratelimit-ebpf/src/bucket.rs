//! GCRA token buckets, exact when several CPUs charge the same bucket at once.
//!
//! A bucket is a theoretical arrival time (TAT) per limit. A packet of cost `c` conforms when
//! `max(tat, now) + c - now <= tolerance`; it then moves `tat` to `max(tat, now) + c` with a
//! compare-and-swap, so two CPUs never both spend the same token.

use core::intrinsics::{atomic_cxchg, atomic_xadd, atomic_xsub, AtomicOrdering};

use aya_ebpf::Global;
use ratelimit_common::{
    byte_cost_ns, full_for_certain, global, rule_flags, settle_birth,
    share::{self, Domain},
    verdict, Bucket, Limit, Rule, COARSE_LAG_DEFAULT_NS, TAT_UNSETTLED,
};

use crate::scratch::{precise_now, ChargeClock, LimitParams};

/// The most the coarse clock is taken to lag the true time, in ns: `ratelimit_common::coarse_lag_ns`
/// of the running kernel's tick, set by the loader (`ratelimit_common::COARSE_LAG_GLOBAL`); 8 ticks
/// at HZ=100 where it is not. A constant to the verifier (a read-only global).
#[unsafe(no_mangle)]
static COARSE_LAG_NS: Global<u64> = Global::new(COARSE_LAG_DEFAULT_NS);

/// The parameters of one limit: a rule's first (its own fields) or one of its `extra` limits.
/// A trait rather than a copy into one form, so the first limit's path reads the rule's fields
/// in place.
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
/// a bound (CONSTRAINTS.md, "What the verifier refuses"). One with the test-only feature
/// `test-cas-once`, so that a test on 2 CPUs drives the fallback (see Cargo.toml).
const CAS_RETRIES: usize = if cfg!(feature = "test-cas-once") {
    1
} else {
    8
};

/// [`CAS_RETRIES`] for a cluster-scoped limit's bucket: its loop carries the TAT's time (a
/// branch per retry), and eight would take the program past the verifier's budget
/// (CONSTRAINTS.md, "Instruction budget"). Past them, the fetch-and-add fallback judges the
/// packet as exactly (see [`gcra`]).
const CLUSTER_CAS_RETRIES: usize = if cfg!(feature = "test-cas-once") {
    1
} else {
    2
};

/// Longest drop window of a cluster-scoped limit (1 ms): its drops reach its bucket's counter
/// within it. They are its host's demand, which the agent reads every sync round to share the
/// budget out: counted in batches of up to 64 (`DROP_BATCH`), a host's demand read over 100 ms
/// swung several-fold, and the shares with it.
pub const CLUSTER_WINDOW_NS: u64 = 1_000_000;

/// The end of the drop window a charge of a limit with flags `flags` opened at `now` (`until`:
/// when its bucket has a token again), at most [`CLUSTER_WINDOW_NS`] ahead for a cluster-scoped
/// limit. Applied where the window is stored, not in the charge, which is inlined in the
/// program's full frame (CONSTRAINTS.md, "Stack").
#[inline(always)]
pub fn window_end(flags: u32, until: u64, now: u64) -> u64 {
    if flags & rule_flags::CLUSTER != 0 && until > now + CLUSTER_WINDOW_NS {
        now + CLUSTER_WINDOW_NS
    } else {
        until
    }
}

/// Result of charging one limit.
#[derive(PartialEq, Eq, Clone, Copy)]
enum Charge {
    Conforms,
    /// Does not conform, nor will any packet of this cost before `until` (the TAT only grows).
    Exceeds {
        until: u64,
    },
}

/// The clock a charge of `cost` to the TAT at `tat` (of a rule with flags `flags`, a limit with
/// tolerance `tolerance`) is judged on: `(now, floor)`, where `now` is no later than the true time
/// (the check `new - now <= tolerance` is then at least as strict as on the true time) and
/// `floor` no earlier (so `max(tat, floor)` is at least the TAT exact GCRA would charge from). On
/// the precise clock both are `now`.
///
/// On the coarse clock (a rule with [`rule_flags::COARSE_CLOCK`]) `now` is up to
/// [`COARSE_LAG_NS`] behind the true time (several ticks: see
/// `ratelimit_common::COARSE_LAG_TICKS`), and two charges would go wrong with it, so they read
/// the precise clock instead:
/// - a bucket that may be full at the true time (its TAT before `now + COARSE_LAG_NS`): charged
///   from the lagging `now`, its TAT would start up to the lag too early, and the bucket admit
///   the lag's refill (`rate x lag`) more than `burst + rate x t` over an interval that starts
///   then (a burst late in one tick, more at the start of the next);
/// - a charge that does not conform at the lagging `now`: it may conform at the true time (the
///   burst's last packets would be dropped, and a source whose packet found a shared bucket
///   empty would wait for the next tick while another took the refill).
///
/// Any other (a bucket at least `COARSE_LAG_NS` from full that has a token: a source at or above
/// its rate) is charged from its TAT on the coarse clock, with `floor = now + COARSE_LAG_NS`,
/// which cannot be below the true time. The allowance covers the real lag: below it, a full
/// bucket whose TAT fell between the two would be charged from that TAT, behind the true time,
/// and its burst get the difference on top.
///
/// A limit with [`rule_flags::COARSE_ONLY`] (a tolerance of at least 100 lags) takes
/// `(now, floor)` always: it admits no more (its TAT is never behind the true time), and a full
/// bucket, charged from `floor` and judged at the lagging `now`, withholds at most the lag's
/// refill (<= 1% of its burst); a charge that would conform only at the true time is dropped.
///
/// The precise clock is read once a packet (`ck`): the packet's other charges use it too.
#[inline(always)]
fn clock(
    tat: *const u64,
    flags: u32,
    now: u64,
    (cost, tolerance): (u64, u64),
    ck: *mut ChargeClock,
) -> (u64, u64) {
    if flags & rule_flags::COARSE_CLOCK == 0 {
        return (now, now);
    }
    let floor = now + COARSE_LAG_NS.load();
    if flags & rule_flags::COARSE_ONLY != 0 {
        return (now, floor);
    }
    // SAFETY: `tat` points into a map value that outlives this program run.
    let old = unsafe { core::ptr::read_volatile(tat) };
    if old < floor || old + cost - now > tolerance {
        let precise = precise_now(ck);
        (precise, precise)
    } else {
        (now, floor)
    }
}

/// Whether a drop window that ends at `until` (on the clock of a rule with flags `flags`) still
/// holds at `now`. On the coarse clock, a window within [`COARSE_LAG_NS`] of its end may be over
/// at the true time: the precise clock decides (held to the next tick, it kept the source out of
/// a shared bucket's refill that others took meanwhile; see [`clock`]). Under
/// [`rule_flags::COARSE_ONLY`] or `hold` (the window's flag: [`rule_flags::HOLD_WINDOW`] for a
/// source's window, [`rule_flags::HOLD_GATE`] for the per-rule one) the coarse clock decides: a
/// window held up to the lag longer drops packets that would conform, never admits one that
/// would not, and its bucket keeps the tokens meanwhile (the agent's conditions for each flag).
/// At 1,000 packets/s a window lasts 1 ms, inside the lag: without them every dropped packet of
/// a flood read the precise clock (a hot source end to end: 81-83% of drop-all; held, 88%).
#[inline(always)]
pub fn window_holds(flags: u32, hold: u32, now: u64, until: u64, ck: *mut ChargeClock) -> bool {
    if now >= until {
        return false;
    }
    flags & rule_flags::COARSE_CLOCK == 0
        || flags & (rule_flags::COARSE_ONLY | hold) != 0
        || until - now >= COARSE_LAG_NS.load()
        || precise_now(ck) < until
}

/// Brings the TAT at `tat` of a cluster-scoped limit's bucket into the time a charge in `dom`
/// writes (`ratelimit_common::share::base`: a stretched TAT read once the shares lapsed, or a
/// whole-rate one read under a share), its tokens kept, by one compare-and-swap: [`gcra`] then
/// charges a TAT in its own time. Once per charge, outside [`gcra`]'s loop, where its branches
/// would be walked at every retry (CONSTRAINTS.md, "Instruction budget"). A CPU that loses the
/// race leaves the TAT to the one that won (or to [`gcra`], which drops rather than charge a TAT
/// of another time).
#[inline(always)]
fn normalize(tat: *mut u64, now: u64, dom: Domain) {
    if dom == 0 {
        return;
    }
    // SAFETY: `tat` points into a map value that outlives this program run.
    let old = unsafe { core::ptr::read_volatile(tat) };
    if old <= now || share::same_time(old, dom) {
        return;
    }
    let new = share::seal(share::base(old, now, dom), dom);
    // SAFETY: as above; 8-byte aligned.
    unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(tat, old, new)
    };
}

/// Charges `cost` to the TAT at `tat`, if the packet conforms at `now` (see [`clock`]: `floor`
/// is `now` on the precise clock, and an upper bound of the true time on the coarse one), in the
/// time of `dom` (see [`normalize`]). For a cluster-scoped limit, every TAT written is marked
/// with that time (`ratelimit_common::share::STRETCHED`, by arithmetic rather than branches),
/// and a TAT still ahead in another time is not charged: the packet is dropped (fewer tokens,
/// never more; only when another CPU converted it in between).
///
/// The step inside the loop is `ratelimit_common::share::step`, copied: called from here, it
/// took the verifier ~100k instructions more (see its doc); `cluster_shares.rs`'s
/// `the_program_charges_a_cluster_bucket_as_the_shared_arithmetic_says` holds the copies to one.
#[inline(always)]
fn gcra(tat: *mut u64, (now, floor): (u64, u64), cost: u64, tolerance: u64, dom: Domain) -> Charge {
    // 1 for a cluster-scoped limit (its TATs carry the mark), else 0; and the mark this charge
    // writes: 1 at a share in force, 0 at the whole rate.
    let marked = share::marked(dom);
    let mark = share::mark(dom);
    let retries = if dom == 0 {
        CAS_RETRIES
    } else {
        CLUSTER_CAS_RETRIES
    };
    for _ in 0..retries {
        // A plain volatile read (no atomic load: CONSTRAINTS.md, "Arithmetic the target
        // lacks"); the CAS below validates what we read.
        // SAFETY: `tat` points into a map value that outlives this program run.
        let old = unsafe { core::ptr::read_volatile(tat) };
        if old > floor && old & marked != mark {
            return Charge::Exceeds { until: 0 };
        }
        let base = if old > floor { old } else { floor };
        let new = base + cost;
        let new = new + ((new & marked) ^ mark);
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
    // `floor` (the bucket not full) and kept in the time this charge is in, `old + cost` is
    // exactly the step the CAS would have made, so the packet is judged as it would have been.
    // Otherwise (a full bucket, whose TAT the add did not lift to `now`; a TAT of another time; or
    // a packet that does not conform) the charge is taken back and the packet dropped: under
    // contention a packet may be dropped that would have fitted, never admitted beyond `burst +
    // rate x t`. No drop window (`until` 0): the refunds of other CPUs may lower the TAT below
    // what this CPU saw. Costs of cluster-scoped limits are even, so the add keeps the TAT's mark.
    crate::stats::bump_global(global::CONTENDED_FALLBACKS);
    // SAFETY: as above.
    let old = unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(tat, cost) };
    if old >= floor && old + cost - now <= tolerance && old & marked == mark {
        return Charge::Conforms;
    }
    // SAFETY: as above.
    unsafe { atomic_xsub::<u64, u64, { AtomicOrdering::Relaxed }>(tat, cost) };
    Charge::Exceeds { until: 0 }
}

/// The [`Domain`] a charge of `bucket` under `rule` at `now` is in (see
/// `ratelimit_common::share`): 0 for a limit without [`rule_flags::CLUSTER`]; else the bucket's
/// share word, and whether the agent's shares are in force (`shares_until`,
/// `Config::shares_until_ns`, ahead of `now`; once they lapse, every bucket is charged at the
/// whole rate: fail open). Inline, and with the config word passed in: a map lookup here (a
/// helper call) would cost the program's frame a stack slot (CONSTRAINTS.md, "Stack").
#[inline(always)]
fn domain<P: Params>(bucket: *const Bucket, rule: &P, now: u64, ck: *const ChargeClock) -> Domain {
    domain_of(bucket, rule.flags(), now, ck)
}

/// [`domain`] for a limit with flags `flags`.
#[inline(always)]
pub fn domain_of(bucket: *const Bucket, flags: u32, now: u64, ck: *const ChargeClock) -> Domain {
    if flags & rule_flags::CLUSTER == 0 {
        return 0;
    }
    // SAFETY: live map values (the bucket; this CPU's scratch record); plain reads, volatile so
    // that they stay behind the flag's test (CONSTRAINTS.md, "Values kept out of registers").
    unsafe {
        let in_force = now < core::ptr::read_volatile(&raw const (*ck).shares_until);
        let field = core::ptr::read_volatile(&raw const (*bucket).created_share);
        share::domain(true, field, in_force)
    }
}

/// Charges a packet of `len` bytes to `bucket` under `rule` and returns its [`verdict`]
/// (`PASSED`, `DROPPED_RATE` or `DROPPED_BYTES`). On `DROPPED_RATE`, `*drop_until` is the time
/// before which every packet under this bucket would be dropped for its rate too.
///
/// A cluster-scoped limit's bucket is charged in the time of its share while `now <
/// shares_until` (`Config::shares_until_ns`), else at the whole rate (see
/// `ratelimit_common::share`), through [`charge_cluster`].
///
/// `CALL`: through the BPF global function [`rl_charge_cluster`] (from the program's own frame),
/// or inline (from `one_limit`, where a call would stack a third frame past 448 bytes): see
/// CONSTRAINTS.md, "Global functions".
#[inline(always)]
pub fn charge<P: Params, const CALL: bool>(
    bucket: *mut Bucket,
    rule: &P,
    now: u64,
    len: u64,
    drop_until: &mut u64,
    ck: *mut ChargeClock,
) -> usize {
    if rule.flags() & rule_flags::CLUSTER != 0 {
        if !CALL {
            let dom = domain(bucket, rule, now, ck);
            return charge_in(bucket, rule, now, len, drop_until, ck, dom);
        }
        let v = charge_cluster(bucket, rule, now, len, ck);
        // SAFETY: this CPU's live scratch record.
        *drop_until = unsafe { (*ck).until };
        return v;
    }
    charge_in(bucket, rule, now, len, drop_until, ck, 0)
}

/// [`charge`] of a cluster-scoped limit under `rule`: its parameters go through the scratch
/// record (`ChargeClock::limit`) to [`rl_charge_cluster`].
#[inline(always)]
fn charge_cluster<P: Params>(
    bucket: *mut Bucket,
    rule: &P,
    now: u64,
    len: u64,
    ck: *mut ChargeClock,
) -> usize {
    // SAFETY: this CPU's live scratch record.
    unsafe {
        (*ck).limit = LimitParams {
            flags: u64::from(rule.flags()),
            pkt_interval_ns: rule.pkt_interval_ns(),
            pkt_tolerance_ns: rule.pkt_tolerance_ns(),
            byte_interval_fp: rule.byte_interval_fp(),
            byte_tolerance_ns: rule.byte_tolerance_ns(),
        };
        (*ck).now = now;
        (*ck).len = len;
        rl_charge_cluster(bucket, ck)
    }
}

impl Params for LimitParams {
    #[inline(always)]
    fn flags(&self) -> u32 {
        self.flags as u32
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

/// [`charge`] of a cluster-scoped limit's bucket, its parameters in `ck.limit` and its drop
/// window's end left in `ck.until`, in the time of its share (`ratelimit_common::share`).
///
/// A *global* BPF function, as `one_limit` (CONSTRAINTS.md, "Global functions"): the share's
/// time adds branches to every step of the charge, verified here once rather than at each of
/// the program's charges.
///
/// # Safety
/// `bucket` and `ck` are null or point at a live bucket and this CPU's scratch record's clock.
#[inline(never)]
#[no_mangle]
pub unsafe extern "C" fn rl_charge_cluster(bucket: *mut Bucket, ck: *mut ChargeClock) -> usize {
    if bucket.is_null() || ck.is_null() {
        return verdict::PASSED;
    }
    // SAFETY: checked non-null: this CPU's scratch record.
    let (now, len) = unsafe { ((*ck).now, (*ck).len) };
    // SAFETY: checked non-null; this CPU's scratch record, read in place (a copy would take
    // 40 bytes of a frame that the caller's leave little room for). The window's end goes
    // there too (a BPF call returns one word).
    let (params, until) = unsafe { (&(*ck).limit, &mut (*ck).until) };
    *until = 0;
    let dom = domain(bucket, params, now, ck);
    charge_in(bucket, params, now, len, until, ck, dom)
}

/// [`charge`] in the time of `dom` (0: a limit that is not cluster-scoped).
#[inline(always)]
fn charge_in<P: Params>(
    bucket: *mut Bucket,
    rule: &P,
    now: u64,
    len: u64,
    drop_until: &mut u64,
    ck: *mut ChargeClock,
    dom: Domain,
) -> usize {
    // SAFETY: `bucket` points at a live map value; only addresses of fields are taken here.
    let (tat, byte_tat) = unsafe { (&raw mut (*bucket).tat_ns, &raw mut (*bucket).byte_tat_ns) };
    let limits_pkts = rule.flags() & rule_flags::PKT_LIMIT != 0;
    // Both costs are made before any charge, so that the share is not live across the
    // compare-and-swap loops (CONSTRAINTS.md, "Instruction budget").
    let pkt_cost = share::cost(rule.pkt_interval_ns(), dom);
    let byte_cost = if rule.flags() & rule_flags::BYTE_LIMIT != 0 {
        share::cost(byte_cost_ns(len, rule.byte_interval_fp()), dom)
    } else {
        0
    };
    if limits_pkts {
        let tolerance = share::pkt_tolerance(
            rule.pkt_tolerance_ns(),
            rule.pkt_interval_ns(),
            pkt_cost,
            dom,
        );
        if rule.flags() & rule_flags::BORN_COARSE != 0 {
            if rule_flags::born_coarse_in_force(rule.flags())
                && reborn(tat, byte_tat, now, pkt_cost)
            {
                return verdict::PASSED;
            }
            if !settle(tat, byte_tat, ck) {
                return verdict::DROPPED_RATE;
            }
        }
        normalize(tat, now, dom);
        let clock = clock(tat, rule.flags(), now, (pkt_cost, tolerance), ck);
        if let Charge::Exceeds { until } = gcra(tat, clock, pkt_cost, tolerance, dom) {
            *drop_until = until;
            return verdict::DROPPED_RATE;
        }
    }
    if rule.flags() & rule_flags::BYTE_LIMIT != 0 {
        let tolerance = share::byte_tolerance(rule.byte_tolerance_ns(), byte_cost, dom);
        normalize(byte_tat, now, dom);
        let clock = clock(byte_tat, rule.flags(), now, (byte_cost, tolerance), ck);
        if gcra(byte_tat, clock, byte_cost, tolerance, dom) != Charge::Conforms {
            if limits_pkts {
                // The packet was charged a packet token above but is dropped: give it back.
                // SAFETY: as in gcra.
                unsafe { atomic_xsub::<u64, u64, { AtomicOrdering::Relaxed }>(tat, pkt_cost) };
            }
            return verdict::DROPPED_BYTES;
        }
    }
    verdict::PASSED
}

/// Makes the bucket whose packet TAT is at `tat` again from the coarse time `now`, as a new
/// bucket of a limit with [`rule_flags::BORN_COARSE`] is made ([`charge_new`]), if it is full at
/// the true time for certain (`ratelimit_common::full_for_certain`): its TAT `now + cost`
/// marked, by compare-and-swap, then `now` its birth (at `birth`, the byte TAT). `true` if so:
/// the packet conforms (the limit's burst holds 100 packets) and is charged.
///
/// The birth is stored after the TAT: a charge on another CPU that pairs the new marked TAT with
/// the birth before it settles it from an earlier birth, so later (fewer tokens, never more);
/// one that read the TAT before it fails its compare-and-swap.
#[inline(always)]
fn reborn(tat: *mut u64, birth: *mut u64, now: u64, cost: u64) -> bool {
    // SAFETY: both point into a live map value; a plain read, the CAS validates it.
    let old = unsafe { core::ptr::read_volatile(tat) };
    if !full_for_certain(old, now, COARSE_LAG_NS.load()) {
        return false;
    }
    // SAFETY: as above; 8-byte aligned.
    let (_, ok) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
            tat,
            old,
            (now + cost) | TAT_UNSETTLED,
        )
    };
    if ok {
        // SAFETY: as above.
        unsafe { core::ptr::write_volatile(birth, now) };
    }
    ok
}

/// Settles the packet TAT at `tat` of a bucket made on the coarse clock
/// ([`rule_flags::BORN_COARSE`]), if its mark says it is not yet, from its birth at `birth` (its
/// `byte_tat_ns`) and the precise clock (`ratelimit_common::settle_birth`), by compare-and-swap:
/// so of two CPUs charging it at once one settles it and the other charges what it settled.
/// The charge after it reads the precise clock again for free (`ck` keeps it). `false` if it is
/// still marked after two attempts (a refund of its first packet moved it in between, twice):
/// the packet is dropped without a window, as an over-contended charge is ([`gcra`]).
#[inline(always)]
fn settle(tat: *mut u64, birth: *const u64, ck: *mut ChargeClock) -> bool {
    for _ in 0..2 {
        // SAFETY: both point into a live map value; plain reads, the CAS validates them.
        let old = unsafe { core::ptr::read_volatile(tat) };
        if old & TAT_UNSETTLED == 0 {
            return true;
        }
        // SAFETY: as above.
        let born = unsafe { core::ptr::read_volatile(birth) };
        let new = settle_birth(old, born, precise_now(ck), COARSE_LAG_NS.load());
        // SAFETY: as above; 8-byte aligned.
        let (_, ok) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
                tat, old, new,
            )
        };
        if ok {
            return true;
        }
    }
    false
}

/// [`charge`] of a new source's bucket (not yet in the map): full, or, where the key's first
/// packet passed without a bucket (`ratelimit_common::first_owed`), owing that packet's charge
/// until `owed` (0: nothing owed). The verdict and the bucket's TATs after it, packets' and
/// bytes' (0: full, where the rule has no such limit or a full bucket's packet was dropped).
/// Scalars, not a bucket in memory: the caller stores them, volatile.
///
/// `now` must be no earlier than the true time and `judge` no later ([`new_bucket_clocks`]): a bucket that owes is judged as [`gcra`] judges, from
/// `max(owed, now)` against `judge`; one that cannot take the packet keeps what it owes.
/// Under [`rule_flags::BORN_COARSE`] a full bucket's `now` is the coarse time: its TAT is marked
/// for [`settle`] and its byte TAT is the birth (such a limit has no byte limit).
#[inline(always)]
pub fn charge_new<P: Params>(
    rule: &P,
    (now, judge): (u64, u64),
    len: u64,
    owed: u64,
) -> (usize, u64, u64) {
    // A new bucket has no share, so a cluster-scoped one starts at the whole rate; its TAT is
    // not marked (`ratelimit_common::share`): an odd one reads as at the whole rate all the
    // same, and the first charge under a share brings it into the share's time.
    let mut tat = 0;
    if rule.flags() & rule_flags::PKT_LIMIT != 0 {
        if owed > now {
            tat = owed + rule.pkt_interval_ns();
            if tat - judge > rule.pkt_tolerance_ns() {
                return (verdict::DROPPED_RATE, owed, 0);
            }
        } else {
            if rule.pkt_interval_ns() > rule.pkt_tolerance_ns() {
                return (verdict::DROPPED_RATE, 0, 0);
            }
            tat = now + rule.pkt_interval_ns();
            if rule_flags::born_coarse_in_force(rule.flags()) {
                // Born at the coarse time `now` (no byte limit: the word is free).
                return (verdict::PASSED, tat | TAT_UNSETTLED, now);
            }
        }
    }
    let mut byte_tat = 0;
    if rule.flags() & rule_flags::BYTE_LIMIT != 0 {
        let cost = byte_cost_ns(len, rule.byte_interval_fp());
        if cost > rule.byte_tolerance_ns() {
            return (verdict::DROPPED_BYTES, 0, 0);
        }
        byte_tat = now + cost;
    }
    (verdict::PASSED, tat, byte_tat)
}

/// The clocks a new bucket of `rule` is charged on ([`charge_new`]), from the packet's `now`: the
/// time it starts from, no earlier than the true time (a new bucket is full: see [`clock`]), which
/// is the precise clock's on the coarse clock, or under [`rule_flags::COARSE_ONLY`] the coarse
/// clock plus its lag allowance (the new bucket then holds up to the lag's refill less than a
/// full one); and the time it is judged at, no later than the true time (the packet's `now`
/// under `COARSE_ONLY`, else the same); under [`rule_flags::BORN_COARSE`] both the coarse
/// time, the TAT of a full bucket marked for its next charge to settle ([`settle`]): a spoofed
/// flood's new sources, one packet each, read no precise clock (34 ns here).
#[inline(always)]
pub fn new_bucket_clocks<P: Params>(rule: &P, now: u64, ck: *mut ChargeClock) -> (u64, u64) {
    let flags = rule.flags();
    if flags & rule_flags::COARSE_ONLY != 0 {
        (now + COARSE_LAG_NS.load(), now)
    } else if rule_flags::born_coarse_in_force(flags) {
        // The coarse time itself: `charge_new` marks a full bucket's TAT, the next charge
        // settles it; one that owes is judged on it, no later than the true time.
        (now, now)
    } else if flags & rule_flags::COARSE_CLOCK != 0 {
        let precise = precise_now(ck);
        (precise, precise)
    } else {
        (now, now)
    }
}

/// `t` plus the most the clock of a limit with flags `flags` lags the true time: nothing on the
/// precise clock, [`COARSE_LAG_NS`] on the coarse one.
#[inline(always)]
pub fn latest(flags: u32, t: u64) -> u64 {
    if flags & rule_flags::COARSE_CLOCK != 0 {
        t + COARSE_LAG_NS.load()
    } else {
        t
    }
}

/// Gives back what [`charge`] took from `bucket` for a packet of `len` bytes that conformed to
/// it but that a later limit of its rule dropped: the packet spends no token of this limit.
///
/// Exact: the charge moved the TAT from `old` to `max(old, floor) + cost` (see [`clock`]:
/// `floor` is the true time where the bucket may have been full); taking `cost` back leaves
/// `max(old, floor)`, which is `old` or a full bucket, the same thing to every later packet.
/// Other CPUs' charges in between commute with it (atomic adds). The only effect the charge has
/// is while it stands: a packet of the same bucket judged on another CPU in those few
/// nanoseconds sees one packet's cost more (and may be dropped where it would have fitted).
#[inline(always)]
pub fn refund<P: Params>(
    bucket: *mut Bucket,
    rule: &P,
    len: u64,
    now: u64,
    ck: *const ChargeClock,
) {
    // The domain as the charge read it, unless the agent changed the share or the shares lapsed
    // in between: then a TAT no longer in the charge's time is left as it is (the packet keeps
    // its cost: fewer tokens, never more), and one still in it gets the cost at the new share
    // back (differing from the charge by the cost's change for one packet).
    let dom = domain(bucket, rule, now, ck);
    // SAFETY: `bucket` points at a live map value; atomic subtractions of its TAT words.
    unsafe {
        let tat = &raw mut (*bucket).tat_ns;
        if rule.flags() & rule_flags::PKT_LIMIT != 0
            && share::same_time(core::ptr::read_volatile(tat), dom)
        {
            atomic_xsub::<u64, u64, { AtomicOrdering::Relaxed }>(
                tat,
                share::cost(rule.pkt_interval_ns(), dom),
            );
        }
        let byte_tat = &raw mut (*bucket).byte_tat_ns;
        if rule.flags() & rule_flags::BYTE_LIMIT != 0
            && share::same_time(core::ptr::read_volatile(byte_tat), dom)
        {
            atomic_xsub::<u64, u64, { AtomicOrdering::Relaxed }>(
                byte_tat,
                share::cost(byte_cost_ns(len, rule.byte_interval_fp()), dom),
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
