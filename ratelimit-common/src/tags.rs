//! The bucket store's tags and first-packet slots ([`map_names::BUCKET_TAGS`]): a 64-byte
//! line for each [`TAG_LINE_RECORDS`] records (a group of [`TAG_LINE_SETS`] sets, where a key's
//! two sets are: [`crate::bucket_sets`]), holding a byte for each of its records, the tag of the
//! key it holds ([`bucket_tag`]), and [`FIRST_LINE_WORDS`] first-packet slots for the keys of
//! the group that have no record ([`crate::first_pick`]). So a key's look before its records is
//! one line: its 8 candidate tags say whether any record may hold it, without reading the
//! records (64 MiB at 2^20 records: a new source's look there is a memory miss), and a key with
//! none stamps a slot of the same line. The table is 2 MiB at 2^20 records, 2 bytes a record;
//! a smaller store's is 2 MiB too, its lines after its groups' holding slots alone
//! ([`FIRST_MIN_LINES`], [`first_line`]): a flood's first packets hold as many slots whatever
//! the store's size.
//! A line of a table this size is a miss in a core's L2 here whatever its size above 256 KiB
//! (docs/journal.md, "A first packet's frame end to end"): one line, not a tag line and a slot
//! line of two tables, is what a new source's first packet costs end to end.
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

/// Records whose tags share a line of [`map_names::BUCKET_TAGS`].
pub const TAG_LINE_RECORDS: u32 = 32;

/// Sets whose tags share a line: a key's two sets are among them ([`crate::bucket_sets`]).
pub const TAG_LINE_SETS: u32 = TAG_LINE_RECORDS / BUCKET_WAYS;

/// `u64` words of a line of [`map_names::BUCKET_TAGS`] (its value).
pub const TAG_LINE_WORDS: usize = 8;

/// A line of [`map_names::BUCKET_TAGS`]: words `0..TAG_WORDS` hold its records' tags (record
/// `k` of the group in byte `k`), the rest its first-packet slots.
pub type TagLine = [u64; TAG_LINE_WORDS];

/// Tags in one `u64` word of a line.
pub const TAGS_PER_WORD: u32 = 8;

/// Words of a line that hold tags.
pub const TAG_WORDS: u32 = TAG_LINE_RECORDS / TAGS_PER_WORD;

/// Slots of a line ([`crate::first_pick`]): the words after its tags.
pub const FIRST_LINE_WORDS: u32 = TAG_LINE_WORDS as u32 - TAG_WORDS;

/// Fewest lines of [`map_names::BUCKET_TAGS`], whatever the store's size: 2^15 lines, 2^17
/// first-packet slots, what a store of 2^20 records has. A flood of one-packet keys holds
/// slots for its rate times the time a slot is held whatever the store's size (the soak's 0.8
/// Mpps, about 26,000): with a store's own lines alone (4 slots for 32 records), a store of 2^17
/// records had 16,384 slots, all held, and one frame in 2.0 made a bucket; with these, one in 42.5
/// (docs/journal.md, "A small store's first-packet slots").
pub const FIRST_MIN_LINES: u32 = 1 << 15;

/// Lines of [`map_names::BUCKET_TAGS`] for each group of sets ([`TAG_LINE_SETS`]) of a store of
/// `groups` groups: its own line, whose tags are its records', and then, in a store of fewer
/// than [`FIRST_MIN_LINES`] groups, lines of slots alone (one every `groups` lines after it) so
/// that the table has at least that many ([`first_line`]).
#[inline(always)]
#[must_use]
pub const fn first_spread(groups: u32) -> u32 {
    if groups >= FIRST_MIN_LINES {
        1
    } else if groups == 0 {
        FIRST_MIN_LINES
    } else {
        FIRST_MIN_LINES.div_ceil(groups)
    }
}

/// Lines of [`map_names::BUCKET_TAGS`] for a store of `capacity` records
/// ([`crate::bucket_capacity`]: whole pages, so whole lines): a line for each group of
/// [`TAG_LINE_RECORDS`] records, times [`first_spread`] (at least [`FIRST_MIN_LINES`]; 2 MiB).
#[inline(always)]
#[must_use]
pub const fn bucket_tag_lines(capacity: u32) -> u32 {
    let groups = capacity.div_ceil(TAG_LINE_RECORDS);
    groups * first_spread(groups)
}

/// The line of [`map_names::BUCKET_TAGS`] whose slots a key with bucket hash `hash` takes for
/// its first packet, in a store of `sets` sets where the key's first set is `first`
/// ([`crate::bucket_sets`]): the line of its tags ([`tag_line`]) in a store of
/// [`FIRST_MIN_LINES`] groups or more (one line for a first packet), else one of its group's
/// [`first_spread`] lines, `line + groups x j`. `j` is the rest of a multiply-shift that gives
/// the page (the top half of the hash over `pages x spread`): the bits under the page's, which
/// the tag and the slot's fingerprint (bits 20..43) do not depend on.
#[inline(always)]
#[must_use]
pub const fn first_line(hash: u64, sets: u32, first: u32) -> u32 {
    let line = tag_line(first);
    let groups = sets / TAG_LINE_SETS;
    let spread = first_spread(groups);
    if spread <= 1 {
        return line;
    }
    let pages = (sets / crate::BUCKET_SETS_PER_PAGE) as u64;
    let x = ((hash >> 32) * (pages * spread as u64)) >> 32;
    line + groups * (x % spread as u64) as u32
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

/// The line of [`map_names::BUCKET_TAGS`] of set `set` (and of a key whose sets these are).
#[inline(always)]
#[must_use]
pub const fn tag_line(set: u32) -> u32 {
    set / TAG_LINE_SETS
}

/// Where set `set`'s tags are in its line ([`tag_line`]): the word and the byte offset in it of
/// its [`BUCKET_WAYS`] tags (a 4-byte half, aligned).
#[inline(always)]
#[must_use]
pub const fn set_tags_at(set: u32) -> (u32, u32) {
    let first = (set % TAG_LINE_SETS) * BUCKET_WAYS;
    (first / TAGS_PER_WORD, first % TAGS_PER_WORD)
}

/// Where record `i`'s tag is: the line of [`map_names::BUCKET_TAGS`] and the byte in it.
#[inline(always)]
#[must_use]
pub const fn record_tag_at(i: u32) -> (u32, u32) {
    (i / TAG_LINE_RECORDS, i % TAG_LINE_RECORDS)
}

/// Record `i`'s tag's byte offset in the whole table (as user space maps it).
#[inline(always)]
#[must_use]
pub const fn record_tag_offset(i: u32) -> usize {
    let (line, at) = record_tag_at(i);
    line as usize * core::mem::size_of::<TagLine>() + at as usize
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

const _: () = assert!(BUCKET_PAGE_RECORDS.is_multiple_of(TAG_LINE_RECORDS));
const _: () = assert!(TAG_LINE_RECORDS.is_multiple_of(TAGS_PER_WORD));
const _: () = assert!(FIRST_LINE_WORDS >= 2);

#[cfg(test)]
mod tests {
    extern crate std;

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

    /// A set's tags are its records' tags, in the order of its ways, in the tag words of its
    /// line: never in a slot word, and each record's byte its own.
    #[test]
    fn a_sets_tags_are_its_records() {
        let mut seen = std::collections::HashSet::new();
        for set in 0..1_000 {
            let (w, at) = set_tags_at(set);
            assert!(w < TAG_WORDS, "set {set}: word {w} is a slot's");
            for k in 0..BUCKET_WAYS {
                let i = set * BUCKET_WAYS + k;
                assert_eq!(record_tag_at(i), (tag_line(set), w * 8 + at + k));
                let off = record_tag_offset(i);
                assert_eq!(off, tag_line(set) as usize * 64 + (w * 8 + at + k) as usize);
                assert!(off % 64 < TAG_WORDS as usize * 8);
                assert!(seen.insert(off), "record {i}: a byte of another's");
            }
            assert_eq!(at % 4, 0);
        }
        assert_eq!(bucket_tag_lines(1 << 20), 1 << 15);
        assert_eq!(FIRST_LINE_WORDS, 4);
    }

    /// Every store has at least [`FIRST_MIN_LINES`] lines of slots; a key's slot line is in the
    /// table, is its tag line from 2^20 records up, and else one of its group's lines (never
    /// another group's tag line), chosen evenly and apart from the key's page: the keys of one
    /// group spread over all its lines.
    #[test]
    fn every_store_has_the_fewest_slot_lines_and_a_keys_line_is_its_groups() {
        use crate::{bucket_sets, siphash13, BUCKET_WAYS};
        for records in [1_024u32, 4_096, 65_536, 100_032, 1 << 17, 1 << 20, 1 << 21] {
            let sets = records / BUCKET_WAYS;
            let groups = sets / TAG_LINE_SETS;
            let lines = bucket_tag_lines(records);
            assert!(lines >= FIRST_MIN_LINES, "{records}: {lines}");
            assert_eq!(lines % groups, 0);
            let spread = lines / groups;
            let mut per_line = std::collections::HashMap::<u32, u32>::new();
            let mut group0 = std::collections::HashSet::new();
            let n = 200_000u64;
            for i in 0..n {
                // The store's own keyed hash, as `bucket_sets`' tests take it.
                let h = siphash13([7, 8], [i], 0, 8);
                let s = bucket_sets(h, sets);
                let line = first_line(h, sets, s[0]);
                assert!(line < lines, "{records}: line {line} of {lines}");
                assert_eq!(line % groups, tag_line(s[0]), "{records}: another group's");
                if records >= 1 << 20 {
                    assert_eq!(line, tag_line(s[0]));
                }
                *per_line.entry(line).or_default() += 1;
                if tag_line(s[0]) == 0 {
                    group0.insert(line);
                }
            }
            // Apart from the page: the keys of one group (one page) take about all of its lines,
            // as many as chance leaves (a `j` that followed the page would give them one).
            let per_group = n as f64 / f64::from(groups) / f64::from(spread);
            let expected = f64::from(spread) * (1.0 - 2.0 * (-per_group).exp()) - 1.0;
            assert!(
                group0.len() as f64 >= expected,
                "{records}: group 0's keys take {} of its {spread} lines",
                group0.len()
            );
            // Evenly: about as many lines unused as chance leaves (e^-share of them), none with
            // three times its share, and each of a group's lines (`j`) taken as often.
            let share = n as f64 / f64::from(lines);
            let unused = f64::from(lines) - per_line.len() as f64;
            assert!(
                unused <= 2.0 * f64::from(lines) * (-share).exp() + 16.0,
                "{records}: {unused} lines unused"
            );
            let most = *per_line.values().max().unwrap();
            assert!(
                f64::from(most) < 3.0 * share + 12.0,
                "{records}: {most} vs {share}"
            );
            let mut per_j = std::vec![0u64; spread as usize];
            for (&line, &k) in &per_line {
                per_j[(line / groups) as usize] += u64::from(k);
            }
            let want = n as f64 / f64::from(spread);
            for (j, &k) in per_j.iter().enumerate() {
                assert!(
                    (k as f64 - want).abs() < 0.25 * want + 6.0 * want.sqrt(),
                    "{records}: line {j} of each group taken {k} times, {want} wanted"
                );
            }
        }
    }
}
