//! A limit's bucket record: found through the record the classification slot remembers, or in
//! the bucket store, or created for a source not seen before (with the creation race settled);
//! then charged.

use core::intrinsics::{atomic_or, AtomicOrdering};

use ratelimit_common::{
    bucket_sets, bucket_tag, global, grown_at, grown_entry, grown_slot, new_page_bit, rule_flags,
    verdict, Bucket, BUCKET_WAYS, MAX_LIMITS,
};

use crate::{
    bucket::{self, Params},
    first,
    maps::{BUCKETS, CONFIG, NEW_PAGES},
    scratch::{self, ChargeClock, ClassSlot, Scratch, NO_RECORD},
    stats::bump_global,
    store::{self, Found, Key, Scan},
    tags,
};

/// Finds (or creates) the bucket of `key`, limit `limit` of its rule with parameters `p`, and
/// charges the packet to it: the verdict and the record (null if there is none: `NO_BUCKET`,
/// fail open). The record found is remembered in the slot. On `DROPPED_RATE`, `*until` is the
/// end of the drop window.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the packet's whole context, inlined"
)]
pub fn find_and_charge<P: Params, const CALL: bool>(
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
    let (i, r) = match remembered(key, cached) {
        Some(found) => found,
        None => match look_up::<P, CALL>(key, p, len, now, s, slot, limit) {
            Ok(found) => found,
            Err(done) => return done,
        },
    };
    if p.flags() & rule_flags::CLUSTER != 0 {
        mark_grown(i, r);
    }
    (
        bucket::charge::<_, CALL>(r, p, now, len, until, charge_clock(s)),
        r,
    )
}

/// The record this CPU found for the source last time (`cached`), if it still holds `key`.
#[inline(always)]
fn remembered(key: &Key, cached: u32) -> Option<(u32, *mut Bucket)> {
    if cached == NO_RECORD {
        return None;
    }
    let r = BUCKETS.get_ptr_mut(cached)?;
    store::holds(r, key).then_some((cached, r))
}

/// Looks `key` up in the bucket store: `Ok` with its record, to charge; `Err` with the packet's
/// verdict and record when nothing is left to charge (its first packet passed without a bucket,
/// a bucket was made and charged for it, or there is none to have: `NO_BUCKET`).
#[inline(always)]
fn look_up<P: Params, const CALL: bool>(
    key: &Key,
    p: &P,
    len: u64,
    now: u64,
    s: *mut Scratch,
    slot: *mut ClassSlot,
    limit: u32,
) -> Result<(u32, *mut Bucket), (usize, *mut Bucket)> {
    // Looked up here, on the path that needs it, rather than passed in and kept live across
    // the charge (CONSTRAINTS.md, "Stack").
    let Some(config) = CONFIG.get_ptr(0) else {
        return Err((no_bucket(), core::ptr::null_mut()));
    };
    // SAFETY: a live map value, written whole by the agent before it attaches.
    let (seed, n_sets) = unsafe { ((*config).seed, (*config).bucket_sets) };
    if n_sets == 0 {
        return Err((no_bucket(), core::ptr::null_mut()));
    }
    // The key's family, not the packet's: a per-rule key is one for both.
    let hash = ratelimit_common::bucket_hash(
        seed,
        key.header as u32 & 0xffff,
        (key.header >> 16) as u8,
        key.addr,
    );
    let sets = bucket_sets(hash, n_sets);
    let tag = bucket_tag(hash);
    // The rule's own limit only (`CALL`): in `one_limit`'s frame the look at the line of
    // first-packet slots would take the chain through it past 448 bytes (CONSTRAINTS.md,
    // "Stack"); the agent sets the flag on no other.
    let first_free = CALL && rule_flags::first_free_in_force(p.flags());
    // The key's 8 candidate tags first: one line of a table that stays in the caches, where
    // its records are a memory miss. None its own says the key has no record
    // (`ratelimit_common::tags`): its first packet may pass without one, the store untouched.
    let tagged = !first_free || tags::may_hold(tags::line_of(sets), sets, tag);
    let mut owed = 0;
    if !tagged {
        owed = owed_or_pass((n_sets, sets), hash, p, now, s)?;
    }
    // A bucket to make (or a tag that matched, a hint): the records decide. One published
    // after the tags were read is found here (its tag went on before it was published).
    match store::find(key, sets) {
        Found::Hit(i, r) => {
            remember(slot, limit, i);
            Ok((i, r))
        }
        Found::Unusable => Err((no_bucket(), core::ptr::null_mut())),
        Found::Miss => {
            if first_free && tagged {
                owed = owed_or_pass((n_sets, sets), hash, p, now, s)?;
            }
            Err(make(p, len, now, s, owed, key, (sets, tag), slot, limit))
        }
    }
}

/// What the first-packet slots of its line say of a key (sets `sets` of the store's `n_sets`,
/// hash `hash`) with no record (`first::owed`): `Err` with the verdict when its packet passes
/// without a bucket (counted), else what its bucket owes (1: nothing, a bucket made full). The
/// line is looked up here rather than kept live from the tags' look (CONSTRAINTS.md, "Stack").
#[inline(always)]
fn owed_or_pass<P: Params>(
    (n_sets, sets): (u32, [u32; 2]),
    hash: u64,
    p: &P,
    now: u64,
    s: *mut Scratch,
) -> Result<u64, (usize, *mut Bucket)> {
    let line = tags::first_line_of(hash, n_sets, sets);
    let owed = first::owed(line, hash, p, now, charge_clock(s));
    if owed == 0 {
        bump_global(global::FIRST_PACKETS);
        return Err((verdict::PASSED, core::ptr::null_mut()));
    }
    Ok(owed)
}

/// A bucket made for `key`, which has no record, in the record its sets give up
/// (`store::choose`), owing `owed` for its first packet if that passed without it: the packet's
/// verdict and the record, as [`create`] gives them.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the packet's whole context, inlined"
)]
fn make<P: Params>(
    p: &P,
    len: u64,
    now: u64,
    s: *mut Scratch,
    owed: u64,
    key: &Key,
    (sets, tag): ([u32; 2], u8),
    slot: *mut ClassSlot,
    limit: u32,
) -> (usize, *mut Bucket) {
    let Scan::Miss {
        victim,
        header,
        kind,
    } = store::choose(key, sets, scratch::coarse_now(s), s)
    else {
        return (no_bucket(), core::ptr::null_mut());
    };
    // A bucket owing its first packet is judged as a charge is: on a limit whose new buckets
    // are born on the coarse clock, on the precise one (read for the time owed: `first::owed`),
    // not on the coarse, which would judge it up to the lag early.
    let clocks = if owed > 1 && rule_flags::born_coarse_in_force(p.flags()) {
        let t = scratch::precise_now(charge_clock(s));
        (t, t)
    } else {
        bucket::new_bucket_clocks(p, now, charge_clock(s))
    };
    create(
        p,
        len,
        clocks,
        owed,
        key,
        (sets, tag),
        victim,
        header,
        kind,
        slot,
        limit,
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

/// A new bucket for `key` (a full one, or one owing until `owed` for its first packet, which
/// passed without it: see `first`), charged for this packet, in record `victim` of its `sets`,
/// which gets the key's `tag`, on `clocks` (`bucket::new_bucket_clocks`).
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
/// passes uncharged (`bucket_errors`), as one that loses the claim of a record does, or whose
/// chosen record another CPU took meanwhile (`store::scan`): at most one packet per CPU per such
/// race. The record taken is evicted either way: counted.
#[inline(always)]
#[expect(
    clippy::too_many_arguments,
    reason = "the packet's whole context, inlined"
)]
fn create<P: Params>(
    p: &P,
    len: u64,
    clocks: (u64, u64),
    owed: u64,
    key: &Key,
    (sets, tag): ([u32; 2], u8),
    victim: u32,
    header: u64,
    kind: u64,
    slot: *mut ClassSlot,
    limit: u32,
) -> (usize, *mut Bucket) {
    let (v, tat, byte_tat) = bucket::charge_new(p, clocks, len, owed);
    let Some(b) = store::install(
        victim,
        header,
        key,
        (tat, byte_tat, Bucket::created_at(clocks.0)),
        // The first packet, which passed without the bucket, counted in it (its bytes are not
        // known here).
        u32::from(owed > 1),
        tag,
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
    if p.flags() & rule_flags::CLUSTER != 0 {
        flag_new_page(victim);
    }
    remember(slot, limit, victim);
    (v, b)
}

/// Flags record `i`'s page in [`NEW_PAGES`] for the agent's cluster sync, which finds the
/// cluster-scoped limit's new bucket there at its next round. After the record is published, so
/// that a round that takes the flag reads the bucket; the locked OR only when the bit is clear
/// (under a flood of new keys it mostly is not).
#[inline(always)]
fn flag_new_page(i: u32) {
    let (word, bit) = new_page_bit(i);
    if let Some(w) = NEW_PAGES.get_ptr_mut(word) {
        // SAFETY: an 8-aligned word of a live map value.
        unsafe {
            if core::ptr::read_volatile(w) & bit == 0 {
                atomic_or::<u64, u64, { AtomicOrdering::Relaxed }>(w, bit);
            }
        }
    }
}

/// Leaves record `i` (`r`, a bucket of a cluster-scoped limit) in its grown slot of
/// [`NEW_PAGES`] if its count just passed a power of two (`ratelimit_common::grown_at`), unless
/// the slot holds a heavier record: so the agent's sync finds a heavy key it has not published at
/// its next round however many new keys flag pages meanwhile. Before the charge (the count is
/// the packets before this one), so that nothing is kept live across its BPF call. A plain
/// store, not a compare-and-swap: a mark lost to another CPU's in the same instant comes again
/// at the next power.
#[inline(always)]
pub fn mark_grown(i: u32, r: *const Bucket) {
    // SAFETY: `r` is a live record.
    let n = unsafe { (*r).passed_pkts.wrapping_add((*r).dropped_pkts) };
    if !grown_at(n) {
        return;
    }
    if let Some(w) = NEW_PAGES.get_ptr_mut(grown_slot(i)) {
        // SAFETY: an 8-aligned word of a live map value.
        unsafe {
            let old = core::ptr::read_volatile(w);
            let entry = grown_entry(n, i);
            if old != entry && (old as u32 == i || old < entry) {
                core::ptr::write_volatile(w, entry);
            }
        }
    }
}

/// What the packet's charges read of the clocks (`scratch::ChargeClock`): `Config::shares_until_ns`
/// (until when the cluster shares in the buckets hold) as `limit` copied it to this CPU's scratch
/// record for this packet, and the precise clock once read. The scratch pointer is live wherever
/// a bucket is charged, the config's not (kept live, it cost a stack slot).
#[inline(always)]
pub fn charge_clock(s: *mut Scratch) -> *mut ChargeClock {
    // SAFETY: this CPU's live scratch record (only the address is taken).
    unsafe { &raw mut (*s).extra.clock }
}

#[inline(always)]
fn no_bucket() -> usize {
    bump_global(global::BUCKET_ERRORS);
    verdict::NO_BUCKET
}
