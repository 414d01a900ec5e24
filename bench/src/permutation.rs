//! A random single cycle through `0..n`: the order the bench's drivers walk a chain in (F1's
//! dependent reads) or send a population in (the known-source drivers' turns), the same on
//! every run for a given seed.

/// A random cyclic permutation of `0..n` by Sattolo's algorithm (a splitmix64 stream from
/// `seed`): `next[i]` is where the walk goes from `i`, and from any start it visits all `n`
/// before it comes back.
pub fn cyclic_permutation(n: u32, seed: u64) -> Vec<u32> {
    let mut next: Vec<u32> = (0..n).collect();
    let mut state = seed;
    let mut random = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..next.len()).rev() {
        // j < i (never i itself): what makes the permutation one cycle.
        let j = usize::try_from(random() % (i as u64)).expect("j < i");
        next.swap(i, j);
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seed for the tests.
    const SEED: u64 = 0x5eed_f100_0000_0001;

    /// From 0, the walk visits every index once and is back at 0 after exactly `n` steps; every
    /// next index is in range.
    #[test]
    fn the_chain_is_one_cycle_through_all() {
        for n in [1u32, 2, 3, 64, 1000, 4096] {
            let next = cyclic_permutation(n, SEED);
            assert_eq!(next.len(), n as usize);
            assert!(
                next.iter().all(|&i| i < n),
                "n = {n}: an index out of range"
            );
            let mut seen = vec![false; n as usize];
            let mut at = 0u32;
            for step in 0..n {
                assert!(!seen[at as usize], "n = {n}: {at} again at step {step}");
                seen[at as usize] = true;
                at = next[at as usize];
            }
            assert_eq!(at, 0, "n = {n}: not back at the start after n steps");
        }
    }

    /// The seed fixes the chain.
    #[test]
    fn the_chain_is_deterministic() {
        assert_eq!(
            cyclic_permutation(1000, SEED),
            cyclic_permutation(1000, SEED)
        );
        assert_ne!(
            cyclic_permutation(1000, SEED),
            cyclic_permutation(1000, SEED + 1)
        );
    }
}
