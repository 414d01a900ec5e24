//! A population of tracked sources in the store, for [`super::populations`]: their addresses,
//! the census that counts them, growing the population to a size, and after each run freeing
//! its new sources and putting back the tracked ones they pushed out.

use anyhow::{bail, Context as _, Result};
use ratelimit::maps::store::Slot;
use ratelimit_common::{Bucket, BucketKey, BUCKET_WAYS};

use crate::kernel::{fill, Limiter};
use crate::refs::Refs;

/// Source address number `i` of the tracked population (10.0.0.0/9), or of the never-seen
/// sources (10.128.0.0/9) when `fresh`.
pub(super) fn tracked_addr(i: usize, fresh: bool) -> [u8; 4] {
    #[expect(clippy::cast_possible_truncation, reason = "bytes of i, masked")]
    let b = |shift: u32| (i >> shift) as u8;
    [
        10,
        (b(16) & 0x7f) | if fresh { 0x80 } else { 0 },
        b(8),
        b(0),
    ]
}

/// Live buckets of rule `rule` in the store: `(tracked population, never-seen sources)`, i.e.
/// addresses in 10.0.0.0/9 and in 10.128.0.0/9 (see [`tracked_addr`]).
pub(super) fn census(limiter: &Limiter, rule: u32) -> Result<(u64, u64)> {
    let (mut population, mut fresh) = (0, 0);
    limiter.tdp.maps().for_each_bucket(|_, b| {
        if u32::from(b.rule) == rule && b.family == 4 && b.addr[0] == 10 {
            if b.addr[1] & 0x80 == 0 {
                population += 1;
            } else {
                fresh += 1;
            }
        }
    })?;
    Ok((population, fresh))
}

/// The addresses of the tracked population of rule `rule` that hold a bucket now, and the
/// records that hold them.
pub(super) fn population_addrs(limiter: &Limiter, rule: u32) -> Result<(Vec<[u8; 4]>, Vec<u32>)> {
    let (mut addrs, mut records) = (Vec::new(), Vec::new());
    limiter.tdp.maps().for_each_bucket(|i, b| {
        if u32::from(b.rule) == rule && b.family == 4 && b.addr[0] == 10 && b.addr[1] & 0x80 == 0 {
            addrs.push([b.addr[0], b.addr[1], b.addr[2], b.addr[3]]);
            records.push(i);
        }
    })?;
    Ok((addrs, records))
}

/// The first record of each of the two sets of rule `rule`'s key for each of `addrs` (per
/// source, IPv4), as the agent finds them (`MappedStore::sets_of`). Fails unless each address's
/// record (`records`) is one of its sets'.
pub(super) fn key_sets(
    limiter: &Limiter,
    rule: u32,
    addrs: &[[u8; 4]],
    records: &[u32],
) -> Result<Vec<([u8; 4], [u32; 2])>> {
    let maps = limiter.tdp.maps();
    let config = maps.config()?;
    addrs
        .iter()
        .zip(records)
        .map(|(a, &i)| {
            let mut addr = [0u8; 16];
            addr[..4].copy_from_slice(a);
            let key = BucketKey {
                rule,
                family: 4,
                _pad: [0; 3],
                addr,
            };
            let firsts = maps
                .store()
                .sets_of(config.seed, config.bucket_sets, &key)
                .context("the bucket store is unusable")?
                .map(|s| s * BUCKET_WAYS);
            if !firsts.iter().any(|&f| (f..f + BUCKET_WAYS).contains(&i)) {
                bail!("{a:?}: its record {i} is in neither of its sets ({firsts:?})");
            }
            Ok((*a, firsts))
        })
        .collect()
}

/// Frees the records of never-seen sources `first..end` (see [`tracked_addr`]) that hold a
/// bucket, as an empty record (the program takes those first); returns how many it freed.
pub(super) fn free_fresh(limiter: &Limiter, rule: u32, first: usize, end: usize) -> Result<u64> {
    let maps = limiter.tdp.maps();
    let mut freed = 0;
    for i in first..end {
        let mut addr = [0u8; 16];
        addr[..4].copy_from_slice(&tracked_addr(i, true));
        let key = BucketKey {
            rule,
            family: 4,
            _pad: [0; 3],
            addr,
        };
        if let (Slot::Found(index), _) = maps.locate_bucket(&key, 0)? {
            let old = maps.store().get(index).header();
            if maps.store().install(index, old, &Bucket::default()) {
                freed += 1;
            }
        }
    }
    Ok(freed)
}

/// Puts back the buckets of `addrs` (rule `rule`) that are no longer in the store, as full
/// buckets written the way the program writes a new one (into the record it would take);
/// returns how many it put back.
pub(super) fn restore(limiter: &Limiter, rule: u32, addrs: &[[u8; 4]]) -> Result<u64> {
    let maps = limiter.tdp.maps();
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write to.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &raw mut ts) };
    let now = u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000
        + u64::try_from(ts.tv_nsec).unwrap_or(0);
    let mut restored = 0;
    for a in addrs {
        let mut addr = [0u8; 16];
        addr[..4].copy_from_slice(a);
        let key = BucketKey {
            rule,
            family: 4,
            _pad: [0; 3],
            addr,
        };
        if let (Slot::Vacant { index, header, .. }, gen) = maps.locate_bucket(&key, now)? {
            let fresh = Bucket {
                addr,
                rule: u16::try_from(rule).context("rule id")?,
                family: 4,
                state: 0,
                rule_gen: gen,
                created_share: Bucket::created_at(now),
                ..Bucket::default()
            };
            if maps
                .store()
                .install_tagged(index, header, &fresh, maps.bucket_tag(&key)?)
            {
                restored += 1;
            }
        }
    }
    Ok(restored)
}

/// Grows the tracked population of rule `tracked` (sources from 10.0.0.0 on, one packet each)
/// until the store holds `target` of them, sending at most `limit` sources in all; `sent` is how
/// many were sent so far and is advanced. Returns the population's live buckets.
pub(super) fn grow(
    limiter: &Limiter,
    refs: &Refs,
    tracked: u32,
    sent: &mut usize,
    target: u64,
    limit: usize,
) -> Result<u64> {
    loop {
        let (population, _) = census(limiter, tracked)?;
        if population >= target || *sent >= limit {
            return Ok(population);
        }
        // At least 1/64 of the gap's worth at a time: near capacity most new sources take the
        // record of another (every set of the source full), so the count creeps up.
        let want = usize::try_from(target - population)
            .unwrap_or(usize::MAX)
            .max(usize::try_from(target / 64).unwrap_or(0))
            .max(1)
            .min(limit - *sent);
        fill(
            limiter,
            refs,
            tracked_addr(*sent, false),
            u32::try_from(want).context("population")?,
        )?;
        *sent += want;
    }
}
