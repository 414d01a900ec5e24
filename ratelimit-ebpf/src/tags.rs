//! The bucket store's tags (`ratelimit_common::tags`, where what holds is): read for a key's two
//! sets before its records, written for a new bucket before it is published.

use ratelimit_common::{record_tag_at, set_tags_at, ways_hold};

use crate::maps::BUCKET_TAGS;

/// Whether a record of `sets` may hold a key of tag `tag`: one of their 8 tags is `tag`, or the
/// tags cannot be read (then the records decide, as without tags).
#[inline(always)]
pub fn may_hold(sets: [u32; 2], tag: u8) -> bool {
    ways(sets[0], tag) || ways(sets[1], tag)
}

/// [`may_hold`] for one set.
#[inline(always)]
fn ways(set: u32, tag: u8) -> bool {
    let (word, at) = set_tags_at(set);
    let Some(w) = BUCKET_TAGS.get_ptr(word) else {
        return true;
    };
    // SAFETY: a live map value of 8 bytes; `at` is 0 or 4 (a set's 4 tags, aligned). Racy: a
    // tag written meanwhile is the caller's to settle (see `find`).
    let ways = unsafe { core::ptr::read_volatile(w.cast::<u32>().add((at / 4) as usize)) };
    ways_hold(ways, tag)
}

/// Gives record `i` the tag `tag`.
#[inline(always)]
pub fn set(i: u32, tag: u8) {
    let (word, at) = record_tag_at(i);
    if let Some(w) = BUCKET_TAGS.get_ptr_mut(word) {
        // SAFETY: a byte of a live map value of 8 bytes (`at` < 8). A plain byte store: other
        // CPUs write the word's other bytes only, each its own record's.
        unsafe { core::ptr::write_volatile(w.cast::<u8>().add((at & 7) as usize), tag) };
    }
}
