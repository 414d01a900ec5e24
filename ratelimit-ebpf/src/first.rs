//! A key's first packet without a bucket: the slots of its line of `RL_BUCKET_TAGS` (after its
//! tags), which say whether it may pass so (see `ratelimit_common::first_owed` and
//! `first_pick`, where the arithmetic and why it holds are).

use core::intrinsics::{atomic_cxchg, AtomicOrdering};

use ratelimit_common::{
    first_fingerprint, first_owed_elsewhere, first_pick, first_stamp, rule_flags, FirstPick,
    TagLine, FIRST_LINE_WORDS, TAG_WORDS,
};

use crate::{
    bucket::{self, Params},
    scratch::{self, ChargeClock},
};

/// For a key with bucket hash `hash` and no record, whose line of slots is `line`
/// (`tags::first_line_of`, null if it could not be read), under limit `p` whose clock reads
/// `now` (the precise clock read once a packet in `ck`, where it is needed): 0 if the packet
/// passes without a bucket (a slot of its line now holds when the key's bucket
/// would be full again); else what the key's new bucket owes until (`bucket::charge_new`'s
/// `owed`: 1 or less, nothing).
///
/// The slot is taken with a compare-and-swap, so of two CPUs (or two keys) that find it free at
/// once only one passes so; the other makes a bucket that owes as if it had been the one (fewer
/// tokens, never more). One key's packets on two CPUs that take two slots of its line at once:
/// the later one's look at the rest of the line sees the earlier's time, and it makes the
/// bucket owing its own (`first_owed_elsewhere`): at most one passes free.
// A BPF call of its own, not inlined: inlined twice, its code sat in the middle of the known
// source's path and cost that path 7-10 ns (its instructions spread over more of the cache).
#[inline(never)]
pub fn owed<P: Params>(
    line: *mut TagLine,
    hash: u64,
    p: &P,
    now: u64,
    ck: *mut ChargeClock,
) -> u64 {
    let interval = p.pkt_interval_ns();
    let flags = p.flags();
    if line.is_null() {
        return 1;
    }
    // SAFETY: a live map value of 8 words; its slots are the words after its tags.
    let slots = unsafe { line.cast::<u64>().add(TAG_WORDS as usize) };
    let fp = first_fingerprint(hash);
    // The time the line is judged at, no later than the true time (the packet's clock), and the
    // one a slot's key's bucket is full again from, no earlier: the precise clock's time on a
    // coarse-clock limit that keeps two-sided exactness, else the coarse time plus its lag
    // allowance (`bucket::latest`): a limit whose buckets are born on the coarse clock (its
    // burst holds 100 x the lag) owes at most the lag's refill more, under 1% of its burst, and
    // a first packet reads no precise clock (34 ns in the kernel alone; end to end, 1.34x against
    // 1.48x the LRU contender). The slots it holds longer are what a line's 4 are for.
    let start = if flags & rule_flags::COARSE_CLOCK != 0
        && flags & rule_flags::COARSE_ONLY == 0
        && !rule_flags::born_coarse_in_force(flags)
    {
        scratch::precise_now(ck)
    } else {
        bucket::latest(flags, now)
    };
    let span = bucket::latest(flags, interval);
    // SAFETY: the 4 slot words of a live map value of 8 words; other CPUs write them only by
    // the compare-and-swap below, which validates what was read.
    let read = |k: u32| unsafe { core::ptr::read_volatile(slots.add((k & 3) as usize)) };
    let (k, old) = match first_pick(read, fp, now, span) {
        // Stamped from the coarse time plus the whole lag allowance, the time owed may be up to
        // the lag later than exact GCRA's (the first packet came at a true time in `[stamp -
        // lag - interval, stamp - interval]`, and no later than this packet): on a limit whose
        // buckets are born on the coarse clock, owed no later than this packet's precise time
        // plus one interval, as `ratelimit_common::settle_birth` settles a bucket born so:
        // never less than exact's, at most one packet more (1% of its burst). Under
        // `COARSE_ONLY` the limit withholds the lag's refill anyway.
        FirstPick::Owed(t) => {
            if rule_flags::born_coarse_in_force(flags) {
                let cap = scratch::precise_now(ck) + interval;
                return if t < cap { t } else { cap };
            }
            return t;
        }
        FirstPick::Make => return 1,
        FirstPick::Take { k, old } => (k, old),
    };
    let full_at = start + interval;
    // SAFETY: as above; 8-aligned.
    let (_, ok) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
            slots.add((k & 3) as usize),
            old,
            first_stamp(full_at, fp),
        )
    };
    if !ok || first_owed_elsewhere(read, fp, now, span, k) {
        return full_at;
    }
    0
}

// The masks above: 4 tag words, then 4 slots.
const _: () = assert!(TAG_WORDS == 4 && FIRST_LINE_WORDS == 4);
