//! The bucket store: its geometry, a record's header word, the keyed hash that places a key,
//! the two sets and eight candidate records a key may take, and how a new key picks its victim.

use crate::{family, Bucket, BucketKey, Rule, TAG_LINE_SETS};
#[cfg(doc)]
use crate::{global, map_names};

/// Default capacity of the bucket store (tracked sources) when the config does not say.
pub const DEFAULT_MAX_BUCKETS: u32 = 1 << 20;
/// Records per set of the bucket store.
pub const BUCKET_WAYS: u32 = 4;
/// Sets a key may live in (two choices, picked by one keyed hash; see [`bucket_sets`]): a key's
/// bucket is one of `BUCKET_CHOICES * BUCKET_WAYS` records, and a new one goes to the less
/// loaded of its sets, which keeps sets even (a single choice of 8 overflows some sets at a third
/// of capacity). Eight candidate records, so eight sources that collide all keep their buckets.
pub const BUCKET_CHOICES: u32 = 2;
/// Records a key's bucket may be in.
pub const BUCKET_CANDIDATES: u32 = BUCKET_CHOICES * BUCKET_WAYS;
/// `BPF_F_MMAPABLE` (from `linux/bpf.h`): the flag of the bucket store's array.
pub const BPF_F_MMAPABLE: u32 = 1 << 10;

/// Sets of the bucket store in one 4 KiB page (16 sets of 4 records of 64 bytes): a key's two sets
/// are in the same page (see [`bucket_sets`]).
pub const BUCKET_SETS_PER_PAGE: u32 = 16;

/// Capacity of the bucket store for `max_buckets` tracked sources: rounded up to whole pages of
/// sets.
#[inline(always)]
#[must_use]
pub const fn bucket_capacity(max_buckets: u32) -> u32 {
    max_buckets.div_ceil(BUCKET_PAGE_RECORDS) * BUCKET_PAGE_RECORDS
}

/// Records of the bucket store in one 4 KiB page.
pub const BUCKET_PAGE_RECORDS: u32 = BUCKET_WAYS * BUCKET_SETS_PER_PAGE;

/// [`Bucket::state`]: the record is being written for a new key (matches no key, is no victim).
pub const BUCKET_BUSY: u8 = 1;

/// Byte offset of the header word in a [`Bucket`].
pub const BUCKET_HEADER_OFFSET: usize = 16;

/// The header word of a bucket for `rule` (id), `family` and `rule_gen`, with `state` 0: bytes
/// 16..24 of the record read as a little-endian u64.
#[inline(always)]
#[must_use]
pub const fn bucket_header(rule: u32, family: u8, rule_gen: u32) -> u64 {
    (rule as u64 & 0xffff) | (family as u64) << 16 | (rule_gen as u64) << 32
}

impl Bucket {
    /// The key this record holds.
    #[must_use]
    pub fn key(&self) -> BucketKey {
        BucketKey {
            rule: u32::from(self.rule),
            family: self.family,
            _pad: [0; 3],
            addr: self.addr,
        }
    }

    /// The header word (see [`bucket_header`]), `state` included.
    #[must_use]
    pub fn header(&self) -> u64 {
        bucket_header(u32::from(self.rule), self.family, self.rule_gen)
            | u64::from(self.state) << 24
    }
}

/// The SipHash-1-3 round function.
#[inline(always)]
fn sip_round(v: &mut [u64; 4]) {
    v[0] = v[0].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(13) ^ v[0];
    v[0] = v[0].rotate_left(32);
    v[2] = v[2].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(16) ^ v[2];
    v[0] = v[0].wrapping_add(v[3]);
    v[3] = v[3].rotate_left(21) ^ v[0];
    v[2] = v[2].wrapping_add(v[1]);
    v[1] = v[1].rotate_left(17) ^ v[2];
    v[2] = v[2].rotate_left(32);
}

/// SipHash-1-3 under `seed` of a message of `len` bytes (`len` < 256, `len / 8 == N`): its whole
/// words `m` (little-endian), then its last `len % 8` bytes in the low bytes of `last` (the rest of
/// `last` zero). A keyed pseudo-random function, so whoever does not know the seed cannot choose
/// inputs that collide. SipHash takes one round per word and one for the last block: a 7-byte
/// message costs 4 rounds, 24 bytes 7.
#[inline(always)]
#[must_use]
pub fn siphash13<const N: usize>(seed: [u64; 2], m: [u64; N], last: u64, len: u8) -> u64 {
    let mut v = [
        seed[0] ^ 0x736f_6d65_7073_6575,
        seed[1] ^ 0x646f_7261_6e64_6f6d,
        seed[0] ^ 0x6c79_6765_6e65_7261,
        seed[1] ^ 0x7465_6462_7974_6573,
    ];
    let mut i = 0;
    while i < N {
        v[3] ^= m[i];
        sip_round(&mut v);
        v[0] ^= m[i];
        i += 1;
    }
    let b: u64 = (len as u64) << 56 | last;
    v[3] ^= b;
    sip_round(&mut v);
    v[0] ^= b;
    v[2] ^= 0xff;
    sip_round(&mut v);
    sip_round(&mut v);
    sip_round(&mut v);
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

/// The keyed hash of a bucket key: SipHash-1-3 under `seed` of its address and its rule (the
/// header's 16 bits: id and limit) and family, without the generation (a rule's buckets stay in
/// their sets across generations). The message is as short as the family allows: an IPv4 key's
/// 4 address bytes, the rule's 2 and the family's 1 (7 bytes: one block, 4 rounds in all); an
/// IPv6 key's 16, then the same 3 (19 bytes: 6 rounds). The family byte and SipHash's length
/// byte keep the two kinds of message apart. An IPv4 key's address bytes 4..16 are zero (see
/// [`family::V4`]) and not hashed.
#[inline(always)]
#[must_use]
pub fn bucket_hash(seed: [u64; 2], rule: u32, family: u8, addr: [u64; 2]) -> u64 {
    let tail = bucket_header(rule, family, 0);
    if family == family::V4 {
        siphash13(seed, [], addr[0] & 0xffff_ffff | tail << 32, 7)
    } else {
        siphash13(seed, addr, tail, 19)
    }
}

/// How much giving a record away loses, the bucket store's order of eviction (lowest first): see
/// [`victim_score`].
pub mod victim {
    /// Empty, or stale (its rule generation is no longer in force): nothing lost.
    pub const FREE: u64 = 0;
    /// Its bucket has refilled: nothing lost (a new bucket starts full), counted as
    /// [`crate::global::EVICTED_FULL`].
    pub const FULL: u64 = 1;
    /// From here on: in debt, `DEBT + ` the debt's time in ns (the later TAT's lead over
    /// `now`, capped at [`DEBT_CAP_NS`]): how long the bucket takes to refill, which is what an
    /// eviction hands back, compared alike under every rule (a fraction of each limit's own
    /// burst would rank one packet under a `burst = 1` limit with a bucket deep in debt under
    /// another). The source starts full again if it comes back, counted as
    /// [`crate::global::EVICTED_LOST`].
    pub const DEBT: u64 = 2;
    /// Being written by another CPU: not to be taken.
    pub const BUSY: u64 = u64::MAX;

    /// The kind of a score: [`FREE`], [`FULL`], [`DEBT`] (any debt) or [`BUSY`].
    #[inline(always)]
    #[must_use]
    pub const fn class(score: u64) -> u64 {
        if score == BUSY {
            BUSY
        } else if score > DEBT {
            DEBT
        } else {
            score
        }
    }
    /// Debts longer than this (18 minutes) rank alike.
    pub const DEBT_CAP_NS: u64 = 1 << 40;
}

/// The [`victim`] score of a record with header `header` and TATs `tat`, `byte_tat` at `now`,
/// given `rule`, the current record of its rule id (`None`: no such id), whose generation says
/// whether the record is stale. `now` must not be ahead
/// of the clock of the rule's buckets (the coarse clock never is), so a bucket judged refilled
/// has refilled.
#[inline(always)]
#[must_use]
pub fn victim_score(header: u64, tat: u64, byte_tat: u64, rule: Option<&Rule>, now: u64) -> u64 {
    if (header >> 24) as u8 & BUCKET_BUSY != 0 {
        return victim::BUSY;
    }
    if (header >> 16) as u8 == 0 {
        return victim::FREE;
    }
    let Some(rule) = rule else {
        return victim::FREE;
    };
    if rule.bucket_gen == 0 || u64::from(rule.bucket_gen) != header >> 32 {
        return victim::FREE;
    }
    // A TAT not settled yet ([`crate::TAT_UNSETTLED`]) as charged: its bucket is new.
    let tat = crate::tat_as_charged(tat);
    let later = if tat > byte_tat { tat } else { byte_tat };
    if later <= now {
        return victim::FULL;
    }
    let debt = later - now;
    victim::DEBT
        + if debt > victim::DEBT_CAP_NS {
            victim::DEBT_CAP_NS
        } else {
            debt
        }
}

/// Picks the candidate (0..[`BUCKET_CANDIDATES`], see [`bucket_candidate`]) a new key takes,
/// from each candidate's [`victim_score`] offered in order: a free record in the less occupied of
/// the two sets (the first set on a tie), else the record whose loss is least (the first on a
/// tie). Scalars only, no indexed array: the verifier can prune the program's scan loop.
#[derive(Clone, Copy, Debug)]
pub struct VictimChooser {
    used: [u32; 2],
    free: [u32; 2],
    best: u64,
    best_at: u32,
}

impl Default for VictimChooser {
    fn default() -> Self {
        Self::new()
    }
}

impl VictimChooser {
    /// Nothing offered yet.
    #[inline(always)]
    #[must_use]
    pub const fn new() -> Self {
        Self {
            used: [0; 2],
            free: [u32::MAX; 2],
            best: victim::BUSY,
            best_at: u32::MAX,
        }
    }

    /// Sets `*this` to [`VictimChooser::new`] field by field, volatile (see [`Self::offer`]): the
    /// XDP program's `write_volatile` of a whole chooser built it on the program's stack first.
    ///
    /// # Safety
    /// `this` is valid for writes.
    #[inline(always)]
    pub unsafe fn reset(this: *mut Self) {
        use core::ptr::write_volatile as set;
        // SAFETY: the caller's `this`, valid for writes.
        unsafe {
            set(&raw mut (*this).used[0], 0);
            set(&raw mut (*this).used[1], 0);
            set(&raw mut (*this).free[0], u32::MAX);
            set(&raw mut (*this).free[1], u32::MAX);
            set(&raw mut (*this).best, victim::BUSY);
            set(&raw mut (*this).best_at, u32::MAX);
        }
    }

    /// Candidate `c` would lose `score`.
    ///
    /// Every field is read and written with a volatile access: the XDP program keeps its chooser
    /// in per-CPU map memory, where the verifier does not track values, and this keeps the
    /// compiler from holding them in registers instead (whose many constant states the verifier
    /// would check one by one). Field by field, not the whole struct: a copy of it per candidate
    /// cost tens of ns.
    #[inline(always)]
    pub fn offer(&mut self, c: u32, score: u64) {
        use core::ptr::{read_volatile as get, write_volatile as set};
        let half = usize::from(c >= BUCKET_WAYS);
        // SAFETY: fields of `self`, valid for reads and writes.
        unsafe {
            if score == victim::FREE {
                if get(&raw const self.free[half]) == u32::MAX {
                    set(&raw mut self.free[half], c);
                }
            } else {
                set(
                    &raw mut self.used[half],
                    get(&raw const self.used[half]) + 1,
                );
            }
            if score < get(&raw const self.best) {
                set(&raw mut self.best, score);
                set(&raw mut self.best_at, c);
            }
        }
    }

    /// The candidate to take and its score; `None` if every candidate is busy.
    #[inline(always)]
    #[must_use]
    pub fn choose(&self) -> Option<(u32, u64)> {
        use core::ptr::read_volatile as get;
        // SAFETY: fields of `self`, valid for reads.
        let (free, used, best, best_at) = unsafe {
            (
                [get(&raw const self.free[0]), get(&raw const self.free[1])],
                [get(&raw const self.used[0]), get(&raw const self.used[1])],
                get(&raw const self.best),
                get(&raw const self.best_at),
            )
        };
        if free[0] != u32::MAX && (free[1] == u32::MAX || used[0] <= used[1]) {
            return Some((free[0], victim::FREE));
        }
        if free[1] != u32::MAX {
            return Some((free[1], victim::FREE));
        }
        if best == victim::BUSY {
            None
        } else {
            Some((best_at, best))
        }
    }
}

/// A 16-byte address field as the two little-endian words the hash and the header compare use.
#[inline(always)]
#[must_use]
pub fn addr_words(addr: &[u8; 16]) -> [u64; 2] {
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    lo.copy_from_slice(&addr[..8]);
    hi.copy_from_slice(&addr[8..]);
    [u64::from_le_bytes(lo), u64::from_le_bytes(hi)]
}

/// The two sets (each 0..`sets`) of a key whose [`bucket_hash`] is `hash`: a page of
/// [`BUCKET_SETS_PER_PAGE`] sets from the high half of the hash (a multiply-shift, no division),
/// then a group of [`TAG_LINE_SETS`] sets of that page from bit 3, then two different sets of
/// that group from the low bits: the first from bits 0..3, the second one of the 7 others from
/// bits 4..20 (a multiply-shift again). Set `s` holds records `s * BUCKET_WAYS .. (s + 1) *
/// BUCKET_WAYS`. Both in one page, so a key that is not in the CPU's caches costs one TLB miss
/// rather than two (measured: a new source's packet ~100 ns less); both in one group, so the
/// key's 8 tags and its first-packet slots are one line of [`map_names::BUCKET_TAGS`] (see
/// [`crate::tags`]); the two choices still even out the sets of a group, and the keyed hash
/// spreads keys over the groups. Always two different sets, so every key has
/// [`BUCKET_CANDIDATES`] records: with the second set drawn from all of them, one key in 16 had
/// the same set twice, 4 records, and 5 sources that shared it evicted one another (layout
/// epoch 4).
#[inline(always)]
#[must_use]
pub const fn bucket_sets(hash: u64, sets: u32) -> [u32; 2] {
    let pages = sets / BUCKET_SETS_PER_PAGE;
    if pages == 0 {
        // A store smaller than a page (never made by `bucket_capacity`): any two sets of the
        // first group.
        let n = if sets < TAG_LINE_SETS {
            sets
        } else {
            TAG_LINE_SETS
        } as u64;
        return [
            (((hash >> 32) * n) >> 32) as u32,
            (((hash & 0xffff_ffff) * n) >> 32) as u32,
        ];
    }
    let page = (((hash >> 32) * pages as u64) >> 32) as u32;
    let group = ((hash >> 3) as u32) & (BUCKET_SETS_PER_PAGE / TAG_LINE_SETS - 1);
    let base = page * BUCKET_SETS_PER_PAGE + group * TAG_LINE_SETS;
    let first = (hash as u32) & (TAG_LINE_SETS - 1);
    let other = ((((hash >> 4) & 0xffff) * (TAG_LINE_SETS as u64 - 1)) >> 16) as u32;
    let second = (first + 1 + other) & (TAG_LINE_SETS - 1);
    [base + first, base + second]
}

// The bits `bucket_sets` takes: the first set 0..3, the group 3, the second set 4..20.
const _: () = assert!(TAG_LINE_SETS == 8 && BUCKET_SETS_PER_PAGE == 2 * TAG_LINE_SETS);

/// Record index of candidate `c` (0..[`BUCKET_CANDIDATES`]) of a key whose sets are `sets`: the
/// first set's ways, then the second's.
#[inline(always)]
#[must_use]
pub const fn bucket_candidate(sets: [u32; 2], c: u32) -> u32 {
    if c < BUCKET_WAYS {
        sets[0] * BUCKET_WAYS + c
    } else {
        sets[1] * BUCKET_WAYS + (c - BUCKET_WAYS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{bucket_rule, extra_index, split_bucket_rule, Limit, MAX_LIMITS, MAX_RULES};
    use core::hash::Hasher as _;

    /// SipHash-1-3 of `bytes` under `seed` as the `siphasher` crate computes it.
    fn reference_siphash13(seed: [u64; 2], bytes: &[u8]) -> u64 {
        let mut h = siphasher::sip::SipHasher13::new_with_keys(seed[0], seed[1]);
        h.write(bytes);
        h.finish()
    }

    /// [`siphash13`] is SipHash-1-3 (checked against the `siphasher` crate's implementation on
    /// the same bytes, for messages of every length from 0 to 31 bytes), so the store's set hash
    /// is as strong as its seed.
    #[test]
    fn siphash13_is_siphash_1_3() {
        fn check<const N: usize>(seed: [u64; 2], words: [u64; 4], len: usize) {
            let mut bytes = [0u8; 32];
            for (i, w) in words.iter().enumerate() {
                bytes[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
            }
            let bytes = &bytes[..len];
            let m: [u64; N] = core::array::from_fn(|i| words[i]);
            let rest = len % 8;
            let last = if rest == 0 {
                0
            } else {
                words[N] & ((1u64 << (8 * rest)) - 1)
            };
            assert_eq!(
                siphash13(seed, m, last, len as u8),
                reference_siphash13(seed, bytes),
                "{len} bytes"
            );
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..200 {
            let seed = [next(), next()];
            let words = [next(), next(), next(), next()];
            for len in 0..32 {
                match len / 8 {
                    0 => check::<0>(seed, words, len),
                    1 => check::<1>(seed, words, len),
                    2 => check::<2>(seed, words, len),
                    _ => check::<3>(seed, words, len),
                }
            }
        }
    }

    /// [`bucket_hash`] hashes the bytes its doc names: an IPv4 key's 7, an IPv6 key's 19.
    #[test]
    fn bucket_hash_hashes_the_keys_bytes() {
        let seed = [0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210];
        let sip = |bytes: &[u8]| reference_siphash13(seed, bytes);
        let rule = 0x1234;
        let v4 = addr_words(&[198, 18, 7, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            bucket_hash(seed, rule, family::V4, v4),
            sip(&[198, 18, 7, 9, 0x34, 0x12, family::V4])
        );
        let a6 = [0x20, 1, 0xd, 0xb8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        let mut m6 = a6.to_vec();
        m6.extend_from_slice(&[0x34, 0x12, family::V6]);
        assert_eq!(
            bucket_hash(seed, rule, family::V6, addr_words(&a6)),
            sip(&m6)
        );
        // The rule and the family count: the same address under another rule, or read as the
        // other family, hashes apart.
        assert_ne!(
            bucket_hash(seed, rule, family::V4, v4),
            bucket_hash(seed, rule + 1, family::V4, v4)
        );
        assert_ne!(
            bucket_hash(seed, rule, family::V4, v4),
            bucket_hash(seed, rule, family::V6, v4)
        );
    }

    #[test]
    fn a_key_has_two_sets_in_range_and_eight_candidates() {
        let sets = 1000;
        for i in 0..10_000u64 {
            let h = siphash13([1, 2], [i], 0, 8);
            let s = bucket_sets(h, sets);
            assert!(s[0] < sets && s[1] < sets);
            let c: [u32; 8] = core::array::from_fn(|c| bucket_candidate(s, c as u32));
            assert_eq!(c[..4], [s[0] * 4, s[0] * 4 + 1, s[0] * 4 + 2, s[0] * 4 + 3]);
            assert_eq!(c[4..], [s[1] * 4, s[1] * 4 + 1, s[1] * 4 + 2, s[1] * 4 + 3]);
        }
        assert_eq!(bucket_capacity(1), 64);
        assert_eq!(bucket_capacity(1 << 20), 1 << 20);
        assert_eq!(bucket_capacity(1001), 1024);
        // Both sets in one group of 8 sets (one page, one line of tags), and never the same
        // set: 8 distinct candidates.
        for i in 0..10_000u64 {
            let s = bucket_sets(siphash13([3, 4], [i], 0, 8), 1 << 18);
            assert_eq!(s[0] / BUCKET_SETS_PER_PAGE, s[1] / BUCKET_SETS_PER_PAGE);
            assert_eq!(s[0] / TAG_LINE_SETS, s[1] / TAG_LINE_SETS);
            assert_ne!(s[0], s[1], "key {i}");
        }
    }

    /// Every pair of different sets of a group is drawn about equally often (28 unordered
    /// pairs in each of a page's two groups; none from the same set twice, none across groups),
    /// so the two choices even out the group.
    #[test]
    fn a_keys_two_sets_are_different_and_spread_over_the_group() {
        let mut pairs = [[0u32; 16]; 16];
        let n = 224_000u64;
        for i in 0..n {
            let [a, b] = bucket_sets(siphash13([5, 6], [i], 0, 8), 16);
            assert_ne!(a, b, "key {i}: the same set twice");
            pairs[a.min(b) as usize][a.max(b) as usize] += 1;
        }
        let want = n as f64 / 56.0;
        for (a, row) in pairs.iter().enumerate() {
            for (b, &count) in row.iter().enumerate().skip(a + 1) {
                let got = f64::from(count);
                if a / 8 != b / 8 {
                    assert_eq!(count, 0, "sets {a} and {b}: two groups");
                    continue;
                }
                assert!(
                    (got / want - 1.0).abs() < 0.1,
                    "sets {a} and {b}: {got} keys, want ~{want:.0}"
                );
            }
        }
    }

    #[test]
    fn each_limit_is_scored_by_its_debt_in_time() {
        // Whatever each limit's tolerance, a bucket exactly 1 ms in debt scores 1 ms.
        let mut rule = Rule {
            bucket_gen: 7,
            pkt_tolerance_ns: 1_000_000,
            byte_tolerance_ns: 1_000_000,
            ..Rule::default()
        };
        for (i, ms) in [2u64, 4, 8].into_iter().enumerate() {
            rule.extra[i].pkt_tolerance_ns = ms * 1_000_000;
            rule.extra[i].byte_tolerance_ns = ms * 1_000_000;
        }
        let now = 1_000_000_000;
        for k in 0..4u32 {
            let header = bucket_header(bucket_rule(3, k), family::V4, 7);
            let score = victim_score(header, now + 1_000_000, now, Some(&rule), now);
            assert_eq!(score, victim::DEBT + 1_000_000, "limit {k}");
        }
        assert_eq!(extra_index(1), 0);
        assert_eq!(extra_index(2), 1);
        assert_eq!(extra_index(3), 2);
        assert_eq!(extra_index(0), MAX_LIMITS - 2, "out of range: clamped");
        assert_eq!(extra_index(9), MAX_LIMITS - 2, "out of range: clamped");
    }

    fn choose(scores: [u64; 8]) -> Option<(u32, u64)> {
        let mut c = VictimChooser::new();
        for (i, s) in scores.into_iter().enumerate() {
            c.offer(i as u32, s);
        }
        c.choose()
    }

    /// A chooser reset in place (as the XDP program resets the one in its scratch record)
    /// chooses as a new one, whatever it was offered before.
    #[test]
    fn a_chooser_reset_in_place_chooses_as_a_new_one() {
        use victim::{DEBT, FREE, FULL};
        let cases = [
            [FREE; 8],
            [FULL, FREE, FREE, FREE, FULL, FREE, FREE, FREE],
            [
                DEBT + 5,
                DEBT + 1,
                FULL,
                DEBT,
                DEBT + 9,
                FULL,
                DEBT + 2,
                DEBT + 3,
            ],
        ];
        for before in cases {
            for after in cases {
                let mut c = VictimChooser::new();
                for (i, s) in before.into_iter().enumerate() {
                    c.offer(i as u32, s);
                }
                // SAFETY: a chooser of our own.
                unsafe { VictimChooser::reset(&raw mut c) };
                for (i, s) in after.into_iter().enumerate() {
                    c.offer(i as u32, s);
                }
                assert_eq!(c.choose(), choose(after), "{before:?} then {after:?}");
            }
        }
    }

    #[test]
    fn victims_are_free_records_of_the_emptier_set_then_the_least_lost() {
        use victim::{BUSY, DEBT, FREE, FULL};
        // Free records: in the less occupied set, the first set on a tie.
        assert_eq!(choose([FREE; 8]), Some((0, FREE)));
        assert_eq!(
            choose([FULL, FREE, FREE, FREE, FREE, FREE, FREE, FREE]),
            Some((4, FREE))
        );
        assert_eq!(
            choose([FULL, FREE, FREE, FREE, FULL, FREE, FREE, FREE]),
            Some((1, FREE))
        );
        assert_eq!(
            choose([FULL, FULL, FULL, FULL, FULL, FULL, FULL, FREE]),
            Some((7, FREE))
        );
        // No free record: a refilled one before any in debt, the least in debt otherwise.
        assert_eq!(
            choose([DEBT + 9, DEBT + 3, FULL, DEBT, DEBT, DEBT, DEBT, DEBT]),
            Some((2, FULL))
        );
        assert_eq!(
            choose([
                DEBT + 9,
                DEBT + 3,
                DEBT + 7,
                BUSY,
                DEBT + 5,
                DEBT + 4,
                BUSY,
                DEBT + 8
            ]),
            Some((1, DEBT + 3))
        );
        assert_eq!(choose([BUSY; 8]), None);
    }

    /// Debt is compared in time, alike under every limit: one packet under a `burst = 1`
    /// limit of 1 pps (1 s to refill) ranks below a bucket 4 s in debt under a limit of burst
    /// 5 (4 of its 5 tokens spent), though it has spent its whole burst and the other 80%.
    #[test]
    fn what_eviction_loses_is_the_debt_in_time_under_any_limit() {
        const S: u64 = 1_000_000_000;
        let mut rule = Rule {
            bucket_gen: 7,
            pkt_interval_ns: S,
            pkt_tolerance_ns: S,
            ..Rule::default()
        };
        rule.set_limit(
            1,
            Limit {
                pkt_interval_ns: S,
                pkt_tolerance_ns: 5 * S,
                ..Limit::default()
            },
        );
        assert_eq!(rule.limits(), 2);
        assert_eq!(split_bucket_rule(bucket_rule(3, 1)), (3, 1));
        assert_eq!(
            split_bucket_rule(bucket_rule(MAX_RULES - 1, 3)),
            (MAX_RULES - 1, 3)
        );
        let now = 100 * S;
        let one_packet = victim_score(
            bucket_header(3, family::V4, 7),
            now + S,
            0,
            Some(&rule),
            now,
        );
        let deep = victim_score(
            bucket_header(bucket_rule(3, 1), family::V4, 7),
            now + 4 * S,
            0,
            Some(&rule),
            now,
        );
        assert_eq!(one_packet - victim::DEBT, S);
        assert_eq!(deep - victim::DEBT, 4 * S);
        // A byte debt counts as a packet debt of the same time; the later TAT decides.
        let bytes = victim_score(
            bucket_header(3, family::V4, 7),
            now,
            now + 4 * S,
            Some(&rule),
            now,
        );
        assert_eq!(bytes, deep);
        // Beyond the cap, alike.
        let h = bucket_header(3, family::V4, 7);
        assert_eq!(
            victim_score(h, now + 2 * victim::DEBT_CAP_NS, 0, Some(&rule), now),
            victim::DEBT + victim::DEBT_CAP_NS
        );
    }

    #[test]
    fn what_eviction_loses_is_judged_by_the_rule_in_force() {
        let rule = Rule {
            bucket_gen: 7,
            pkt_tolerance_ns: 1000,
            ..Rule::default()
        };
        let h = bucket_header(3, family::V4, 7);
        let now = 10_000;
        // Empty, busy, stale (other generation, freed id, no such rule).
        assert_eq!(victim_score(0, 0, 0, Some(&rule), now), victim::FREE);
        assert_eq!(
            victim_score(h | u64::from(BUCKET_BUSY) << 24, 0, 0, Some(&rule), now),
            victim::BUSY
        );
        assert_eq!(
            victim_score(
                bucket_header(3, family::V4, 6),
                now + 500,
                0,
                Some(&rule),
                now
            ),
            victim::FREE
        );
        let freed = Rule {
            bucket_gen: 0,
            ..rule
        };
        assert_eq!(
            victim_score(
                bucket_header(3, family::V4, 0),
                now + 500,
                0,
                Some(&freed),
                now
            ),
            victim::FREE
        );
        assert_eq!(victim_score(h, now + 500, 0, None, now), victim::FREE);
        // Refilled: nothing lost.
        assert_eq!(victim_score(h, now, 0, Some(&rule), now), victim::FULL);
        // In debt: by the time it takes to refill.
        let half = victim_score(h, now + 500, 0, Some(&rule), now);
        let all = victim_score(h, now + 1000, 0, Some(&rule), now);
        assert!(victim::DEBT < half && half < all, "{half} {all}");
        assert_eq!(half - victim::DEBT, 500);
    }

    /// A creator takes its chosen record only if what it reads back is of no costlier kind than
    /// judged (`store::scan` in the program): every debt is one kind, however deep, and the
    /// kinds rank free < full < in debt < busy.
    #[test]
    fn a_score_has_one_kind_and_the_kinds_rank_by_what_eviction_loses() {
        let rule = Rule {
            bucket_gen: 7,
            pkt_tolerance_ns: 1000,
            ..Rule::default()
        };
        let h = bucket_header(3, family::V4, 7);
        let now = 10_000;
        let score = |header: u64, tat: u64| victim_score(header, tat, 0, Some(&rule), now);
        assert_eq!(victim::class(score(0, 0)), victim::FREE);
        assert_eq!(victim::class(score(h, now)), victim::FULL);
        for debt in [1, 500, 1000, 2 * victim::DEBT_CAP_NS] {
            let s = score(h, now + debt);
            assert!(s > victim::DEBT, "debt {debt}: score {s}");
            assert_eq!(victim::class(s), victim::DEBT, "debt {debt}");
        }
        let busy = score(h | u64::from(BUCKET_BUSY) << 24, now + 500);
        assert_eq!(victim::class(busy), victim::BUSY);
        assert_eq!(victim::class(victim::DEBT), victim::DEBT);
        const { assert!(victim::FREE < victim::FULL && victim::FULL < victim::DEBT) };
        assert!(victim::class(victim::DEBT + victim::DEBT_CAP_NS) < victim::BUSY);
    }
}
