//! The bucket store's tags (`ratelimit_common::tags`, where what holds is): read for a key's two
//! sets before its records, written for a new bucket before it is published. A key's two sets
//! share one line, which holds its first-packet slots too (`first`) in a store of 2^20 records
//! or more.

use ratelimit_common::{
    first_line, record_tag_at, set_tags_at, tag_line, ways_hold, TagLine, TAG_LINE_RECORDS,
    TAG_WORDS,
};

use crate::maps::BUCKET_TAGS;

// The masks below: 4 words of tags, 32 tag bytes a line.
const _: () = assert!(TAG_WORDS == 4 && TAG_LINE_RECORDS == 32);

/// The line of a key's sets (both are in it: `ratelimit_common::bucket_sets`), or null if it
/// cannot be read.
#[inline(always)]
pub fn line_of(sets: [u32; 2]) -> *mut TagLine {
    BUCKET_TAGS
        .get_ptr_mut(tag_line(sets[0]))
        .unwrap_or_default()
}

/// The line whose first-packet slots a key with bucket hash `hash` and sets `sets` takes, in a
/// store of `n_sets` sets (`ratelimit_common::first_line`: its tags' line from 2^20 records up),
/// or null if it cannot be read.
#[inline(always)]
pub fn first_line_of(hash: u64, n_sets: u32, sets: [u32; 2]) -> *mut TagLine {
    BUCKET_TAGS
        .get_ptr_mut(first_line(hash, n_sets, sets[0]))
        .unwrap_or_default()
}

/// Whether a record of `sets` may hold a key of tag `tag`: one of their 8 tags in `line`
/// ([`line_of`]) is `tag`, or the line cannot be read (then the records decide, as without
/// tags).
#[inline(always)]
pub fn may_hold(line: *mut TagLine, sets: [u32; 2], tag: u8) -> bool {
    if line.is_null() {
        return true;
    }
    ways(line, sets[0], tag) || ways(line, sets[1], tag)
}

/// [`may_hold`] for one set.
#[inline(always)]
fn ways(line: *mut TagLine, set: u32, tag: u8) -> bool {
    let (word, at) = set_tags_at(set);
    // SAFETY: a live map value of 8 words; `word` < 4 and `at` is 0 or 4 (a set's 4 tags,
    // aligned). Racy: a tag written meanwhile is the caller's to settle (see `find`).
    let ways = unsafe {
        let w = line.cast::<u64>().add((word & 3) as usize);
        core::ptr::read_volatile(w.cast::<u32>().add((at / 4) as usize & 1))
    };
    ways_hold(ways, tag)
}

/// Gives record `i` the tag `tag`.
#[inline(always)]
pub fn set(i: u32, tag: u8) {
    let (line, at) = record_tag_at(i);
    if let Some(l) = BUCKET_TAGS.get_ptr_mut(line) {
        // SAFETY: one of the first 32 bytes (the tags) of a live map value of 64 bytes. A plain
        // byte store: other CPUs write the line's other tag bytes only, each its own record's,
        // and its slot words by compare-and-swap.
        unsafe { core::ptr::write_volatile(l.cast::<u8>().add((at & 31) as usize), tag) };
    }
}
