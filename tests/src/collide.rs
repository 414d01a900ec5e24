//! Sources chosen to collide in the bucket store, as an attacker who knew the store's seed would
//! choose them: tests set a known seed (or read the agent's from its pins) and search addresses
//! offline for keys whose candidate records are the same, so that they compete for one set pair.

use std::{collections::HashMap, net::Ipv4Addr, path::Path};

use anyhow::{Context, Result};
use ratelimit::maps::PinnedMaps;
use ratelimit_common::{
    addr_words, bucket_candidate, bucket_hash, bucket_sets, family, first_fingerprint, first_line,
    BUCKET_CANDIDATES,
};

/// A fixed seed for tests that need to know where keys go.
pub const TEST_SEED: [u64; 2] = [0x0123_4567_89ab_cdef, 0x0fed_cba9_8765_4321];

/// Replaces the seed of the bucket store pinned in `pin_dir` (before any traffic: buckets
/// created under the old seed are no longer found).
pub fn set_seed(pin_dir: &Path, seed: [u64; 2]) -> Result<()> {
    let mut maps = PinnedMaps::open(pin_dir)?;
    let config = maps.config()?;
    maps.set_config(ratelimit_common::Config { seed, ..config })?;
    Ok(())
}

/// The seed and number of sets of the bucket store pinned in `pin_dir`.
pub fn store_params(pin_dir: &Path) -> Result<([u64; 2], u32)> {
    let config = PinnedMaps::open(pin_dir)?.config()?;
    Ok((config.seed, config.bucket_sets))
}

/// The two sets (sorted) of a `per = "source"` IPv4 key of rule `rule`.
#[must_use]
pub fn sets_of_v4(seed: [u64; 2], sets: u32, rule: u32, ip: Ipv4Addr) -> [u32; 2] {
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&ip.octets());
    let mut s = bucket_sets(bucket_hash(seed, rule, family::V4, addr_words(&addr)), sets);
    s.sort_unstable();
    s
}

/// `n` distinct IPv4 sources from the 2^`span_bits` addresses after `base` whose keys under rule
/// `rule` (`per = "source"`) share both sets, all avoiding `avoid`; their set pair shares no set
/// with the keys of `avoid` (which so keep records of their own beside the `n`).
pub fn colliding_v4(
    seed: [u64; 2],
    sets: u32,
    rule: u32,
    base: Ipv4Addr,
    span_bits: u32,
    n: usize,
    avoid: &[Ipv4Addr],
) -> Result<Vec<Ipv4Addr>> {
    let mut groups: HashMap<[u32; 2], Vec<Ipv4Addr>> = HashMap::new();
    let taken: Vec<u32> = avoid
        .iter()
        .flat_map(|&ip| sets_of_v4(seed, sets, rule, ip))
        .collect();
    for ip in span_v4(base, span_bits) {
        if avoid.contains(&ip) {
            continue;
        }
        let pair = sets_of_v4(seed, sets, rule, ip);
        if pair.iter().any(|s| taken.contains(s)) {
            continue;
        }
        let group = groups.entry(pair).or_default();
        group.push(ip);
        if group.len() == n {
            return Ok(group.clone());
        }
    }
    None.with_context(|| format!("no {n} sources in 2^{span_bits} share a set pair"))
}

/// The addresses the searches here try: the 2^`span_bits` after `base`, without the first and
/// the last (a network's and its broadcast address).
fn span_v4(base: Ipv4Addr, span_bits: u32) -> impl Iterator<Item = Ipv4Addr> {
    let base = u32::from(base);
    (1..(1u32 << span_bits) - 1).map(move |i| Ipv4Addr::from(base + i))
}

/// The distinct candidate records of a `per = "source"` IPv4 key of rule `rule` (sorted): 8 for
/// a key whose two sets differ.
#[must_use]
pub fn records_of_v4(seed: [u64; 2], sets: u32, rule: u32, ip: Ipv4Addr) -> Vec<u32> {
    let s = sets_of_v4(seed, sets, rule, ip);
    let mut r: Vec<u32> = (0..BUCKET_CANDIDATES)
        .map(|c| bucket_candidate(s, c))
        .collect();
    r.sort_unstable();
    r.dedup();
    r
}

/// The attacker's best pick: `n` distinct IPv4 sources from the 2^`span_bits` addresses after
/// `base` whose keys under rule `rule` have the same candidate records, and as few of them as
/// any such group there: where keys have fewer candidates than the store promises (8), this
/// finds them. The sources and how many records they compete for.
pub fn densest_v4(
    seed: [u64; 2],
    sets: u32,
    rule: u32,
    base: Ipv4Addr,
    span_bits: u32,
    n: usize,
) -> Result<(Vec<Ipv4Addr>, usize)> {
    let mut groups: HashMap<Vec<u32>, Vec<Ipv4Addr>> = HashMap::new();
    for ip in span_v4(base, span_bits) {
        groups
            .entry(records_of_v4(seed, sets, rule, ip))
            .or_default()
            .push(ip);
    }
    groups
        .into_iter()
        .filter(|(_, ips)| ips.len() >= n)
        .min_by_key(|(records, ips)| (records.len(), ips[0]))
        .map(|(records, mut ips)| {
            ips.truncate(n);
            (ips, records.len())
        })
        .with_context(|| format!("no {n} sources in 2^{span_bits} share their records"))
}

/// `n` sources (as [`colliding_v4`]) whose set pair is the one `target` has.
pub fn colliding_with_v4(
    seed: [u64; 2],
    sets: u32,
    rule: u32,
    target: Ipv4Addr,
    base: Ipv4Addr,
    span_bits: u32,
    n: usize,
) -> Result<Vec<Ipv4Addr>> {
    let want = sets_of_v4(seed, sets, rule, target);
    let found: Vec<Ipv4Addr> = span_v4(base, span_bits)
        .filter(|&ip| ip != target && sets_of_v4(seed, sets, rule, ip) == want)
        .take(n)
        .collect();
    if found.len() < n {
        anyhow::bail!(
            "only {} sources in 2^{span_bits} share {target}'s sets",
            found.len()
        );
    }
    Ok(found)
}

/// The first-seen table's hash in the version before the bucket store (git 6b656ff,
/// `ratelimit_common::first_seen_hash`): public and unkeyed, so a pair of sources sharing a slot
/// was found offline in a second (issue #10). Kept here only to replay that attack.
#[must_use]
pub fn old_first_seen_slot(rule: u32, ip: Ipv4Addr) -> (u32, u32) {
    let mut a = [0u8; 16];
    a[..4].copy_from_slice(&ip.octets());
    let word = |i: usize| u64::from_ne_bytes(a[i..i + 8].try_into().expect("8 bytes"));
    let mut h = (u64::from(rule) << 8 | u64::from(family::V4)) ^ 0x9e37_79b9_7f4a_7c15;
    h = (h ^ word(0)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 31) ^ word(8)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 29;
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the low 32 bits are the hash"
    )]
    let h = (h as u32) | 1;
    (h & 0xffff, h)
}

/// Two sources of `rule` from the 2^`span_bits` addresses after `base` that shared a slot of
/// the old first-seen table (with different fingerprints): each one's packet overwrote the other's
/// and neither ever got a bucket, so both passed everything.
pub fn old_first_seen_pair(
    rule: u32,
    base: Ipv4Addr,
    span_bits: u32,
) -> Result<(Ipv4Addr, Ipv4Addr)> {
    let mut slots: HashMap<u32, Ipv4Addr> = HashMap::new();
    let base = u32::from(base);
    for i in 1..(1u32 << span_bits) - 1 {
        let ip = Ipv4Addr::from(base + i);
        let (slot, _) = old_first_seen_slot(rule, ip);
        if let Some(&other) = slots.get(&slot) {
            return Ok((other, ip));
        }
        slots.insert(slot, ip);
    }
    anyhow::bail!("no colliding pair in 2^{span_bits}")
}

/// The bucket key of rule `rule`'s own (`per = "source"`) limit for IPv4 source `ip`.
#[must_use]
pub fn key_v4(rule: u32, ip: Ipv4Addr) -> ratelimit_common::BucketKey {
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&ip.octets());
    ratelimit_common::BucketKey {
        rule,
        family: family::V4,
        _pad: [0; 3],
        addr,
    }
}

/// The line of `RL_BUCKET_TAGS` whose first-packet slots (its words after the tags) a
/// `per = "source"` IPv4 key of rule `rule` takes in a store of `sets` sets, and the key's
/// fingerprint, as the program computes them (`ratelimit_common::first_line`).
#[must_use]
pub fn first_line_v4(seed: [u64; 2], sets: u32, rule: u32, ip: Ipv4Addr) -> (u32, u64) {
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&ip.octets());
    let h = bucket_hash(seed, rule, family::V4, addr_words(&addr));
    (
        first_line(h, sets, bucket_sets(h, sets)[0]),
        first_fingerprint(h),
    )
}

/// `n` sources of `rule` from the 2^`span_bits` addresses after `base` whose keys share a line of
/// first-packet slots in a store of `sets` sets, each with a fingerprint of its own: past
/// [`ratelimit_common::FIRST_LINE_WORDS`] of them, the line is full.
pub fn sharing_first_line_v4(
    seed: [u64; 2],
    sets: u32,
    rule: u32,
    base: Ipv4Addr,
    span_bits: u32,
    n: usize,
) -> Result<Vec<Ipv4Addr>> {
    let mut lines: HashMap<u32, Vec<(Ipv4Addr, u64)>> = HashMap::new();
    for ip in span_v4(base, span_bits) {
        let (line, fp) = first_line_v4(seed, sets, rule, ip);
        let keys = lines.entry(line).or_default();
        if keys.iter().all(|&(_, f)| f != fp) {
            keys.push((ip, fp));
            if keys.len() == n {
                return Ok(keys.iter().map(|&(ip, _)| ip).collect());
            }
        }
    }
    anyhow::bail!("no {n} sources in 2^{span_bits} share a first-packet line")
}
