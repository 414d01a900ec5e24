// This module's documentation is on its declaration in lib.rs, where its links resolve.

/// Words per half: one per /16.
pub const SLOTS: u32 = 1 << 16;
/// Words per map entry: a cache line each. (The kernel lays an array's values out 8 bytes
/// apart at least, so one `u32` a value would take twice the memory, and twice the cache.)
pub const WORDS_PER_ENTRY: usize = 16;
/// A map entry's value.
pub type Entry = [u32; WORDS_PER_ENTRY];
/// The map's capacity in entries: both halves of the trie ([`crate::prefix_generation`]),
/// words laid out by [`index`] (word `i` is word `i % 16` of entry `i / 16`).
pub const ENTRIES: u32 = 2 * SLOTS / WORDS_PER_ENTRY as u32;
/// Look in the trie.
pub const TRIE: u32 = 0;
/// Set in a word that holds the outcome: [`NO_RULE`] or a rule id + 1 in the low bits.
pub const DIRECT: u32 = 1 << 31;
/// The low bits of a [`DIRECT`] word when no prefix covers the /16.
pub const NO_RULE: u32 = 0;

/// The word of a /16 whose sources all fall under rule `id` (`None`: under no rule).
#[must_use]
pub const fn direct(id: Option<u32>) -> u32 {
    match id {
        Some(id) => DIRECT | (id + 1),
        None => DIRECT | NO_RULE,
    }
}

/// What `word` holds: `None`, look in the trie; else the rule every source of its /16 falls
/// under (`Some(None)`: none). The inverse of [`direct`].
#[inline(always)]
#[must_use]
pub const fn outcome(word: u32) -> Option<Option<u32>> {
    if word & DIRECT == 0 {
        return None;
    }
    match word & !DIRECT {
        NO_RULE => Some(None),
        low => Some(Some(low - 1)),
    }
}

/// Index of the word of the /16 of `addr` (an IPv4 address's bytes, network order) in trie
/// half `generation` (0 or 1), counted over the whole map.
#[inline(always)]
#[must_use]
pub const fn index(generation: u8, addr: [u8; 2]) -> u32 {
    ((generation as u32 & 1) << 16) | (addr[0] as u32) << 8 | addr[1] as u32
}

#[cfg(test)]
mod tests {
    use super::{direct, outcome, TRIE};
    use crate::MAX_RULES;

    #[test]
    fn an_ipv4_table_word_gives_back_what_it_was_made_from() {
        assert_eq!(outcome(TRIE), None);
        assert_eq!(outcome(direct(None)), Some(None));
        for id in [0, 1, 7, MAX_RULES - 1] {
            assert_eq!(outcome(direct(Some(id))), Some(Some(id)));
        }
    }
}
