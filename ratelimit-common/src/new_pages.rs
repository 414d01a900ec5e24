//! Where the cluster sync finds keys it has not published, in [`map_names::NEW_PAGES`]: the
//! grown slots (buckets of cluster-scoped limits whose count just passed a power of two), then a
//! bit for each page of the bucket store where the program created such a bucket.

use crate::BUCKET_PAGE_RECORDS;
#[cfg(doc)]
use crate::{bucket_capacity, map_names};

/// Words of [`map_names::NEW_PAGES`] for a store of `capacity` records ([`bucket_capacity`]):
/// the [`GROWN_SLOTS`] first, then a bit for each page of records.
#[inline(always)]
#[must_use]
pub const fn new_pages_words(capacity: u32) -> u32 {
    let words = (capacity / BUCKET_PAGE_RECORDS).div_ceil(64);
    GROWN_SLOTS + if words == 0 { 1 } else { words }
}

/// Where [`map_names::NEW_PAGES`] flags record `i`'s page: the word (past the
/// [`GROWN_SLOTS`]), and the bit in it.
#[inline(always)]
#[must_use]
pub const fn new_page_bit(i: u32) -> (u32, u64) {
    let page = i / BUCKET_PAGE_RECORDS;
    (GROWN_SLOTS + page / 64, 1 << (page % 64))
}

/// Words at the head of [`map_names::NEW_PAGES`] where the program leaves buckets of
/// cluster-scoped limits whose count of packets (passed and dropped) just passed a power of two
/// ([`grown_entry`], in slot [`grown_slot`]): a heavy key the cluster sync has not published is
/// in one of them at its next round, however many new keys a spoofed flood makes meanwhile
/// (the pages' flags of those are read a quarter interval a round at most). A slot keeps the
/// heavier of two entries, so a flood's keys push a key out only with as many packets each.
/// A fixed size whatever the store's (32 KiB).
pub const GROWN_SLOTS: u32 = 4096;

/// Packets a bucket's count gains between two consecutive charges of it, at most, on any CPUs:
/// each charge is followed by adding its own packet and the drop window's batch that came
/// before it (`DROP_BATCH` in the program, 64), so consecutive charges find counts at most this
/// far apart. A charge that finds the count within this many past a power of two marks the
/// bucket ([`grown_at`]), so no power is jumped over (but for two CPUs' charges racing).
pub const GROWN_WINDOW: u32 = 65;

/// Whether a charge that finds a bucket's count at `n` marks it grown: a power of two lies in
/// `(n - GROWN_WINDOW, n]` (every charge up to [`GROWN_WINDOW`] packets). The highest bit of `n`
/// is above that of `m = n - GROWN_WINDOW` exactly when `m ^ n > m`.
#[inline(always)]
#[must_use]
pub const fn grown_at(n: u32) -> bool {
    let m = n.saturating_sub(GROWN_WINDOW);
    n != 0 && (m ^ n) > m
}

/// The slot of [`GROWN_SLOTS`] record `i`'s marks go to.
#[inline(always)]
#[must_use]
pub const fn grown_slot(i: u32) -> u32 {
    // The multiplicative hash's top bits: a set's four records go to four scattered slots.
    i.wrapping_mul(0x9e37_79b1) >> (32 - GROWN_SLOTS.trailing_zeros())
}

/// A grown slot's word for record `i` at count `n` (never 0 for `n > 0`): heavier compares
/// greater.
#[inline(always)]
#[must_use]
pub const fn grown_entry(n: u32, i: u32) -> u64 {
    (n as u64) << 32 | i as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`grown_at`] holds exactly where a power of two lies within [`GROWN_WINDOW`] at or
    /// below the count, for every count up to 2^20 and around every power of two above it: so
    /// a charge after a count gained up to `GROWN_WINDOW` packets since the last one still
    /// marks every power it passed.
    #[test]
    fn a_bucket_is_marked_grown_within_the_window_after_each_power_of_two() {
        let window = |n: u32| {
            (0..32).any(|k| {
                let p = 1u64 << k;
                p <= u64::from(n) && u64::from(n) < p + u64::from(GROWN_WINDOW)
            })
        };
        let around = (20..32).flat_map(|k| {
            let p = 1u32 << k;
            p - 200..p.saturating_add(200)
        });
        for n in (0..1 << 20).chain(around).chain([u32::MAX - 1, u32::MAX]) {
            assert_eq!(grown_at(n), window(n), "count {n}");
        }
        // Steps of up to the window from any count never pass a power unmarked.
        for start in 0..5000u32 {
            for step in 1..=GROWN_WINDOW {
                // The highest power of two seen marked (the start's own counts as marked).
                let top = |n: u32| 31 - n.leading_zeros();
                let mut n = start.max(1);
                let mut marked = top(n);
                while n < 20_000 {
                    n += step;
                    if grown_at(n) {
                        marked = top(n);
                    }
                    assert_eq!(top(n), marked, "from {start} in steps of {step}: {n}");
                }
            }
        }
    }

    /// The grown slots sit ahead of the page flags, a record's slot is in bounds, and heavier
    /// entries compare greater whatever the record.
    #[test]
    fn grown_slots_come_first_and_order_by_count() {
        assert_eq!(new_page_bit(0).0, GROWN_SLOTS);
        assert_eq!(new_pages_words(64), GROWN_SLOTS + 1);
        assert_eq!(new_pages_words(1 << 20), GROWN_SLOTS + 256);
        let mut used = [false; GROWN_SLOTS as usize];
        for i in (0..1u32 << 20).step_by(7) {
            assert!(grown_slot(i) < GROWN_SLOTS);
            used[grown_slot(i) as usize] = true;
        }
        assert!(used.iter().all(|u| *u), "every slot is some record's");
        assert!(grown_entry(2, u32::MAX) < grown_entry(3, 0));
        assert_ne!(grown_entry(1, 0), 0);
    }
}
