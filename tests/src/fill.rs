//! A bucket store filled from user space: live records of one of the agent's rules written
//! straight into its pinned store, millions in a second or two, as the XDP program would for as
//! many sources.

use std::path::Path;

use anyhow::{bail, Context as _, Result};
use ratelimit::maps::{bucket::monotonic_ns, PinnedMaps};
use ratelimit_common::{family, Bucket};

/// Writes `n` live buckets of the agent's rule `rule` into records `0..n` of the store pinned at
/// `pin` (source 10.x.y.z for record x.y.z, `passed` packets of 64 bytes passed each; at most
/// the store's records): a record's place is not the one the program would choose, which only a
/// lookup of that source would notice. Returns how many were written.
pub fn fill_store(pin: &Path, rule: &str, n: u32, passed: u32) -> Result<u32> {
    let maps = PinnedMaps::open(pin)?;
    let (id, gen) = maps
        .named_rules()?
        .into_iter()
        .find(|(_, (name, _, _))| name == rule)
        .map(|(id, (_, _, r))| (id, r.bucket_gen))
        .with_context(|| format!("the agent has no rule {rule:?}"))?;
    let store = maps.store();
    let n = n.min(store.records());
    let now = monotonic_ns();
    for i in 0..n {
        let old = store.get(i);
        let mut addr = [0u8; 16];
        addr[..4].copy_from_slice(&(0x0a00_0000 | i).to_be_bytes());
        let b = Bucket {
            addr,
            rule: u16::try_from(id)?,
            family: family::V4,
            state: 0,
            rule_gen: gen,
            tat_ns: now,
            byte_tat_ns: 0,
            created_share: Bucket::created_at(now),
            passed_bytes: u64::from(passed) * 64,
            passed_pkts: passed,
            dropped_pkts: 0,
        };
        if !store.install(i, old.header(), &b) {
            bail!("record {i} was busy");
        }
    }
    Ok(n)
}
