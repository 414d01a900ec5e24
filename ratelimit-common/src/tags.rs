//! The bucket store's tags ([`map_names::BUCKET_TAGS`]): a byte for each record, the tag of the
//! key it holds ([`bucket_tag`]), so that a key's 8 candidate tags (two 4-byte words, one cache
//! line for a whole page of records) say whether any record may hold it, without reading the
//! records (64 MiB at 2^20 records: a new source's look there is a memory miss; the tags' 1 MiB
//! stays in the caches).
//!
//! What holds, and who keeps it so: **every record that holds a key has that key's tag.** The
//! XDP program writes a new bucket's tag after claiming its record and before publishing it
//! (the record is busy, so matches no key, until then); user space writes it before it claims
//! a record for another key ([`crate::map_names::BUCKET_TAGS`]'s writers: the program and
//! `MappedStore::install_tagged`). So a key none of whose candidate tags is its own has no
//! record: its first packet may pass without one (see [`crate::first_owed`]). A tag that
//! matches is only a hint: the record's key decides (a record emptied, or taken for a key of the
//! same tag, leaves it; 8 candidates of 255 tags: about 3% of new keys read their records).

#[cfg(doc)]
use crate::map_names;
use crate::{BUCKET_PAGE_RECORDS, BUCKET_WAYS};

/// Tags in one word of [`map_names::BUCKET_TAGS`].
pub const TAGS_PER_WORD: u32 = 8;

/// Words of [`map_names::BUCKET_TAGS`] for a store of `capacity` records ([`crate::bucket_capacity`]:
/// whole pages, so whole words).
#[inline(always)]
#[must_use]
pub const fn bucket_tags_words(capacity: u32) -> u32 {
    let words = capacity.div_ceil(TAGS_PER_WORD);
    if words == 0 {
        1
    } else {
        words
    }
}

/// The tag of a key whose bucket hash is `hash` (`bucket_hash`): bits 20..28, which the choice of
/// its sets (bits 0..20) and its page (the top bits) do not depend on; never 0, the tag of a
/// record never written.
#[inline(always)]
#[must_use]
pub const fn bucket_tag(hash: u64) -> u8 {
    let t = (hash >> 20) as u8;
    if t == 0 {
        0x80
    } else {
        t
    }
}

/// Where set `set`'s tags are: the word of [`map_names::BUCKET_TAGS`] and the byte offset in it of
/// its [`BUCKET_WAYS`] tags (a 4-byte half, aligned).
#[inline(always)]
#[must_use]
pub const fn set_tags_at(set: u32) -> (u32, u32) {
    let first = set * BUCKET_WAYS;
    (first / TAGS_PER_WORD, first % TAGS_PER_WORD)
}

/// Where record `i`'s tag is: the word of [`map_names::BUCKET_TAGS`] and the byte in it.
#[inline(always)]
#[must_use]
pub const fn record_tag_at(i: u32) -> (u32, u32) {
    (i / TAGS_PER_WORD, i % TAGS_PER_WORD)
}

/// Whether one of the four tags in `ways` (a set's, as read: record `set x 4 + k` in byte `k`,
/// little-endian) is `tag`.
#[inline(always)]
#[must_use]
pub const fn ways_hold(ways: u32, tag: u8) -> bool {
    // The classic zero-byte test on `ways ^ tag x 0x01010101`: exact for "some byte is zero".
    let x = ways ^ (tag as u32).wrapping_mul(0x0101_0101);
    x.wrapping_sub(0x0101_0101) & !x & 0x8080_8080 != 0
}

const _: () = assert!(BUCKET_PAGE_RECORDS.is_multiple_of(TAGS_PER_WORD));
const _: () = assert!(TAGS_PER_WORD.is_multiple_of(BUCKET_WAYS));

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a byte-by-byte look, over every tag and many words: no false answer either way.
    #[test]
    fn ways_hold_is_exact() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut ways = x as u32;
            // Many words with a byte equal to, or one off, the tag looked for.
            let tag = (x >> 40) as u8;
            if x & 0x300 == 0 {
                ways = ways & !0xff00 | u32::from(tag) << 8;
            }
            if x & 0xc00 == 0 {
                ways = ways & !0xff_0000 | u32::from(tag.wrapping_add(1)) << 16;
            }
            let want = ways.to_le_bytes().contains(&tag);
            assert_eq!(ways_hold(ways, tag), want, "{ways:#x} {tag:#x}");
        }
        assert!(!ways_hold(0, 1));
        assert!(ways_hold(0x0100_0000, 1));
        assert!(ways_hold(0x0000_0080, 0x80));
        assert!(!ways_hold(0x0180_8082, 0x81));
        assert!(ways_hold(0x0180_8081, 0x81));
    }

    /// A tag is never 0, and takes about every other value evenly.
    #[test]
    fn tags_are_never_zero_and_spread() {
        let mut seen = [0u32; 256];
        for h in 0..(1u64 << 16) {
            let hash = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let t = bucket_tag(hash);
            assert_ne!(t, 0);
            seen[usize::from(t)] += 1;
        }
        let most = *seen.iter().max().unwrap();
        assert!(most < 2 * 65_536 / 255 + 64, "{most}");
        assert!(seen[1..].iter().all(|&n| n > 0));
    }

    /// A set's tags are its records' tags, in the order of its ways.
    #[test]
    fn a_sets_tags_are_its_records() {
        for set in 0..1_000 {
            let (w, at) = set_tags_at(set);
            for k in 0..BUCKET_WAYS {
                assert_eq!(record_tag_at(set * BUCKET_WAYS + k), (w, at + k));
            }
            assert_eq!(at % 4, 0);
        }
        assert_eq!(bucket_tags_words(1 << 20), 1 << 17);
    }
}
