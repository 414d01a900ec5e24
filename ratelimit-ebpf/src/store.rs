//! The bucket store: an array of [`Bucket`] records that the program addresses itself, instead of
//! a kernel hash map. A key's bucket is one of the records of its two sets (`BUCKET_CANDIDATES`),
//! picked by SipHash under a secret seed (so no one can choose sources that share sets); each
//! record holds its key, so a hit is verified, never assumed. A known source's record index is cached per CPU (`scratch`),
//! which makes its packet one inlined array lookup and a 24-byte compare.
//!
//! A new key takes, in this order of preference, an empty or stale record (a rule generation no
//! longer in force; in the less occupied of its sets), a record whose bucket has refilled (nothing is lost: a new bucket starts
//! full), or the record whose bucket is least in debt relative to its burst (its source starts full
//! again if it comes back: the one allowance the store makes, counted as `evicted_lost`). A source
//! that has been dropped is deep in debt, so a stream of one-packet sources, each at most one
//! packet into its burst, evicts one another before it.

use core::intrinsics::{atomic_cxchg, AtomicOrdering};

use ratelimit_common::{
    bucket_candidate, bucket_header, bucket_rule, family, global, split_bucket_rule, victim,
    victim_score, Bucket, VictimChooser, BUCKET_BUSY, BUCKET_CANDIDATES, BUCKET_WAYS,
};

use crate::{
    maps::{BUCKETS, RULES},
    parse::Packet,
    scratch::{Scratch, NO_RECORD},
};

pub use crate::scratch::Key;

/// The key of limit `limit` of rule `id` (generation `gen`) for `pkt`'s source under `mask`: a
/// mask of all zero (`per = "rule"`) keys one bucket for both families (see
/// `ratelimit_common::family::of_key`).
#[inline(always)]
pub fn key(pkt: &Packet, id: u32, limit: u32, mask: &[u32; 4], gen: u32) -> Key {
    let masked = [
        pkt.src[0] & mask[0],
        pkt.src[1] & mask[1],
        pkt.src[2] & mask[2],
        pkt.src[3] & mask[3],
    ];
    // SAFETY: [u32; 4] and [u64; 2] have the same size and any bit pattern is valid for both (the
    // words are the address bytes read little-endian, as `addr_words` reads them).
    let addr: [u64; 2] = unsafe { core::mem::transmute(masked) };
    Key {
        addr,
        header: bucket_header(
            bucket_rule(id, limit),
            family::of_key(pkt.family, mask[0]),
            gen,
        ),
    }
}

/// The header word of record `b`.
#[inline(always)]
fn header_ptr(b: *mut Bucket) -> *mut u64 {
    // SAFETY: the header is the third u64 of the 64-byte, 8-aligned record (see `Bucket`).
    unsafe { (b as *mut u64).add(2) }
}

/// Whether record `b` holds `key` (and is not being rewritten).
#[inline(always)]
pub fn holds(b: *mut Bucket, key: &Key) -> bool {
    let w = b as *const u64;
    // SAFETY: `b` is a live record of the store; volatile because other CPUs rewrite records.
    unsafe {
        core::ptr::read_volatile(header_ptr(b)) == key.header
            && core::ptr::read_volatile(w) == key.addr[0]
            && core::ptr::read_volatile(w.add(1)) == key.addr[1]
    }
}

/// What a look for a key alone found.
pub enum Found {
    /// The key's record.
    Hit(u32, *mut Bucket),
    /// No record holds the key.
    Miss,
    /// The store is unusable.
    Unusable,
}

/// Looks for `key` among the records of its sets.
#[inline(always)]
pub fn find(key: &Key, sets: [u32; 2]) -> Found {
    for c in 0..BUCKET_CANDIDATES {
        let i = bucket_candidate(sets, c);
        let Some(b) = BUCKETS.get_ptr_mut(i) else {
            return Found::Unusable;
        };
        if holds(b, key) {
            return Found::Hit(i, b);
        }
    }
    Found::Miss
}

/// The record of `key`'s sets (starting at records `first` and `second`), other than `mine`,
/// that holds `key`, or `NO_RECORD`. A BPF function of its own, returning a scalar, so the
/// creation path it serves is verified once, not once more per candidate; one call for both sets,
/// as each BPF call's return is costly. Its frame ends the chain through `one_limit`, the
/// program's deepest (CONSTRAINTS.md, "Stack"): few live values, and `key` a raw pointer, not a
/// reference, whose words the compiler would keep across the map lookups in stack slots.
#[inline(never)]
pub fn other_holder(key: *const Key, first: u32, second: u32, mine: u32) -> u32 {
    for c in 0..BUCKET_CANDIDATES {
        // `bucket_candidate`'s order, from bases the caller computed: calling it here (with the
        // sets) cost `one_limit`'s frame 8 bytes (CONSTRAINTS.md, "Stack").
        let i = if c < BUCKET_WAYS {
            first + c
        } else {
            second + (c - BUCKET_WAYS)
        };
        let Some(b) = BUCKETS.get_ptr_mut(i) else {
            return NO_RECORD;
        };
        // SAFETY: `key` points at the caller's live key (in this CPU's scratch record).
        if i != mine && holds(b, unsafe { &*key }) {
            return i;
        }
    }
    NO_RECORD
}

/// Gives record `b`, which this CPU installed for `key` a moment ago, back (an empty record):
/// another CPU created the same key's bucket at the same time. `false` if the record has
/// already changed hands (then it is not this CPU's to give back).
#[inline(always)]
pub fn release(b: *mut Bucket, key: &Key) -> bool {
    // SAFETY: the header word of a live record, 8-aligned.
    let (_, ok) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
            header_ptr(b),
            key.header,
            0,
        )
    };
    ok
}

/// What [`choose`] found for a key that has no record.
pub enum Scan {
    /// `victim` is the record to take, holding `header` now, of `kind` (a [`victim`] score).
    Miss { victim: u32, header: u64, kind: u64 },
    /// Every record of the set is being rewritten by other CPUs, or the store is unusable.
    None,
}

/// How much is lost by giving record `b` (header `header`) to another key at `now`.
#[inline(always)]
fn score(b: *mut Bucket, header: u64, now: u64) -> u64 {
    // SAFETY: a live record; racy reads only weigh the choice.
    let (tat, byte_tat) = unsafe {
        (
            core::ptr::read_volatile(&raw const (*b).tat_ns),
            core::ptr::read_volatile(&raw const (*b).byte_tat_ns),
        )
    };
    victim_score(
        header,
        tat,
        byte_tat,
        RULES.get(split_bucket_rule(header as u32).0),
        now,
    )
}

/// Picks the record of `key`'s sets to take for its new bucket, `key` having none (see the
/// module's doc for the order). `now` is the coarse clock: never ahead of any rule's clock, so a
/// bucket judged refilled has refilled.
#[inline(always)]
pub fn choose(key: &Key, sets: [u32; 2], now: u64, s: *mut Scratch) -> Scan {
    // A miss: what taking each record would lose. The chooser lives in this CPU's scratch record,
    // not on the stack, so its many constant states do not each get verified (see
    // `scratch::launder`).
    // SAFETY: this CPU's live scratch record.
    let chooser = unsafe { &raw mut (*s).chooser };
    // Field by field: `write_volatile` of a whole chooser built it on the program's frame
    // first (CONSTRAINTS.md, "Stack").
    // SAFETY: as above.
    unsafe { VictimChooser::reset(chooser) };
    for c in 0..BUCKET_CANDIDATES {
        let Some(b) = BUCKETS.get_ptr_mut(bucket_candidate(sets, c)) else {
            return Scan::None;
        };
        // SAFETY: a live record.
        let header = unsafe { core::ptr::read_volatile(header_ptr(b)) };
        let score = score(b, header, now);
        // SAFETY: as above (`offer` reads and writes the fields in place, volatile).
        unsafe { (*chooser).offer(c, score) };
    }
    // SAFETY: as above.
    let Some((c, kind)) = (unsafe { (*chooser).choose() }) else {
        return Scan::None;
    };
    let victim = bucket_candidate(sets, c);
    let Some(b) = BUCKETS.get_ptr_mut(victim) else {
        return Scan::None;
    };
    // Read again rather than kept from the loop (an indexed stack array would defeat the
    // verifier's pruning); the claim's compare-and-swap checks it is still what it is now. It
    // must also still be what was judged: another CPU may have taken the record since, for this
    // very key (taking it again would start the key's bucket full a second time: one more
    // packet, or burst, uncounted) or for another (whose new bucket would go unjudged). Then no
    // record is taken: the packet passes uncharged, counted, as when a claim is lost.
    // SAFETY: a live record.
    let header = unsafe { core::ptr::read_volatile(header_ptr(b)) };
    if holds(b, key) || victim::class(score(b, header, now)) > victim::class(kind) {
        return Scan::None;
    }
    Scan::Miss {
        victim,
        header,
        kind,
    }
}

/// Takes record `i` (now holding `old_header`) for `key`'s new bucket, already charged for its
/// first packet (its TATs `tat`, `byte_tat` and its creation word `created`; the counters start
/// at zero, but for `passed` packets that passed before it had a record): claims it with a
/// compare-and-swap of the header (marking it busy), gives it the key's tag `tag`
/// (`ratelimit_common::tags`: a record that holds a key has its tag, so the tag goes on before
/// the header is published), writes the bucket, then publishes the header. `None` if another CPU
/// claimed the record first.
#[inline(always)]
pub fn install(
    i: u32,
    old_header: u64,
    key: &Key,
    (tat, byte_tat, created): (u64, u64, u64),
    passed: u32,
    tag: u8,
) -> Option<*mut Bucket> {
    let b = BUCKETS.get_ptr_mut(i)?;
    let busy = key.header | u64::from(BUCKET_BUSY) << 24;
    // SAFETY: the header word of a live record, 8-aligned.
    let (_, ok) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
            header_ptr(b),
            old_header,
            busy,
        )
    };
    if !ok {
        return None;
    }
    crate::tags::set(i, tag);
    let w = b as *mut u64;
    // SAFETY: a live record this CPU now owns until the header is published (readers skip busy
    // records; a CPU still charging the record's previous bucket may add to the new TAT, which
    // only makes the new bucket stricter by that one packet).
    unsafe {
        core::ptr::write_volatile(w, key.addr[0]);
        core::ptr::write_volatile(w.add(1), key.addr[1]);
        // Volatile, field by field: plain stores of the zeros the compiler merges into a call
        // of the program's `memset` (a byte loop behind a BPF call).
        core::ptr::write_volatile(&raw mut (*b).tat_ns, tat);
        core::ptr::write_volatile(&raw mut (*b).byte_tat_ns, byte_tat);
        core::ptr::write_volatile(&raw mut (*b).created_share, created);
        core::ptr::write_volatile(&raw mut (*b).passed_bytes, 0);
        core::ptr::write_volatile(&raw mut (*b).passed_pkts, passed);
        core::ptr::write_volatile(&raw mut (*b).dropped_pkts, 0);
        // An atomic write (BPF atomics order the writes before them): the record becomes
        // visible whole.
        atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
            header_ptr(b),
            busy,
            key.header,
        );
    }
    Some(b)
}

/// The global counter a [`Scan::Miss`] of `kind` adds to, besides `new_buckets`.
#[inline(always)]
pub fn eviction_counter(kind: u64) -> Option<usize> {
    match kind {
        victim::FREE => None,
        victim::FULL => Some(global::EVICTED_FULL),
        _ => Some(global::EVICTED_LOST),
    }
}
