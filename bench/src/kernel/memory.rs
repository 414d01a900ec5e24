//! Kernel memory of the bucket store: `memlock` per record, and the marginal cost per tracked
//! source (the slope between two stores' `memlock`).

use anyhow::{Context as _, Result};
use aya::maps::MapData;
use ratelimit_common::map_names;
use serde_json::json;

use super::{Limiter, BASE_RULES};
use crate::report::{Figure, Report};

/// `memlock` and `max_entries` of a pinned map, from /proc/self/fdinfo.
pub fn map_memory(limiter: &Limiter, name: &str) -> Result<(u64, u64)> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let path = limiter.tdp.pin_dir().join(name);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    let fd = data.fd().as_fd().as_raw_fd();
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
    let field = |k: &str| -> Result<u64> {
        info.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no {k} in fdinfo of {name}"))
    };
    Ok((field("memlock:")?, field("max_entries:")?))
}

/// `memlock` of the bucket store and of its lines of tags and first-packet slots (two bytes a
/// record: `ratelimit_common::tags`), together, and the store's records.
fn store_memory(limiter: &Limiter) -> Result<(u64, u64)> {
    let (store, entries) = map_memory(limiter, map_names::BUCKETS)?;
    let (tags, _) = map_memory(limiter, map_names::BUCKET_TAGS)?;
    Ok((store + tags, entries))
}

/// How many times the bench's store the second bucket store [`memory`] loads is, to tell the
/// store's fixed part from what each record costs. Larger, not smaller: the table of tags and
/// first-packet slots has at least `ratelimit_common::FIRST_MIN_LINES` lines (2 MiB, the default
/// store's), so a store under 2^20 records pays 2 MiB of it all the same and a slope down to one
/// would leave the tags out of the per-record cost.
const SECOND_STORE_TIMES: u64 = 2;

/// Kernel memory of the bucket store with its tags: their `memlock` over its records, and over
/// the buckets it tracks (`tracked`, counted with the store full; `None` when it was not filled in this run).
///
/// `memlock` holds a fixed part (the map's header, rounded to pages) beside the records, so the
/// per-source figure is the *marginal* cost: a second program is loaded with a store of
/// [`SECOND_STORE_TIMES`] as many records, and the slope between the two stores' `memlock`
/// (bytes per record) is spread over the sources tracked (the first-packet slots are in the
/// tags' lines, so in the slope). The fixed part and `memlock / tracked` are in the detail.
pub fn memory(report: &mut Report, limiter: &Limiter, tracked: Option<u64>) -> Result<()> {
    let (memlock, entries) = store_memory(limiter)?;
    #[expect(clippy::cast_precision_loss, reason = "bytes")]
    let per = |n: u64| memlock as f64 / n as f64;
    report.add(Figure {
        key: "memory.kernel_per_record".into(),
        section: "Memory and control plane",
        label: format!(
            "kernel memory per record of the bucket store, its tags and first-packet slots \
             ({entries} records)"
        ),
        unit: "bytes",
        runs: vec![per(entries)],
        baseline: None,
        detail: json!({
            "memlock_bytes": memlock,
            "max_entries": entries,
        }),
    });
    if let Some(tracked) = tracked.filter(|&t| t > 0) {
        let records =
            u32::try_from(entries * SECOND_STORE_TIMES).context("the second store's records")?;
        let large = Limiter::new("bench-mem", records, BASE_RULES)?;
        let (large_memlock, large_entries) = store_memory(&large)?;
        drop(large);
        anyhow::ensure!(
            large_entries > entries && large_memlock > memlock,
            "the bucket store of {large_entries} records ({large_memlock} B) is not larger than \
             the one of {entries} ({memlock} B)"
        );
        #[expect(clippy::cast_precision_loss, reason = "bytes")]
        let slope = (large_memlock - memlock) as f64 / (large_entries - entries) as f64;
        #[expect(clippy::cast_precision_loss, reason = "bytes")]
        let fixed = memlock as f64 - slope * entries as f64;
        #[expect(clippy::cast_precision_loss, reason = "bytes")]
        let marginal = slope * entries as f64 / tracked as f64;
        report.add(Figure {
            key: "memory.kernel_per_tracked_source".into(),
            section: "Memory and control plane",
            label: format!(
                "kernel memory per tracked source, tags and first-packet slots included \
                 ({tracked} tracked, store full; the slope between stores of {entries} and \
                 {large_entries} records)"
            ),
            unit: "bytes",
            runs: vec![marginal],
            baseline: None,
            detail: json!({
                "memlock_bytes": memlock,
                "max_entries": entries,
                "tracked_buckets": tracked,
                "second_memlock_bytes": large_memlock,
                "second_max_entries": large_entries,
                "bytes_per_record": slope,
                "fixed_bytes": fixed,
                "memlock_per_tracked": per(tracked),
            }),
        });
    }
    Ok(())
}
