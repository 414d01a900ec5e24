//! Tracked-source populations, 1k to 1M and a full store: the hot path, a random known source
//! and a new source's first packet with the store holding each population, beside their floors
//! and the memory floors (drivers reading records of the store); and the census that grows the
//! population, frees each run's new sources and puts back what they pushed out.

use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use ratelimit::maps::store::Slot;
use ratelimit_common::{global, map_names, Bucket, BucketKey, BUCKET_WAYS};
use serde_json::json;

use super::{
    fill, lru::LruCase, pinned, repeat_ns, sequential_from, v4_frame, Driver, Limiter, TRUNCATION,
};
use crate::{
    kernel::lru::SLACK,
    lru::{Kind, ENTRIES},
    progs::{self, Sources, Touch},
    refs::{Refs, PASS},
    report::{Figure, Report},
    session::Options,
};

/// Sources of the population the `known_few` driver sends, spread over the store (one record
/// a page at 1M): their records' lines fit the last-level cache (8 MiB), their pages do not
/// fit the TLB.
const FEW: usize = 16_384;

pub(super) const SECTION_POP: &str =
    "In-kernel cost per packet vs tracked sources (BPF_PROG_TEST_RUN)";

/// Source address number `i` of the tracked population (10.0.0.0/9), or of the never-seen
/// sources (10.128.0.0/9) when `fresh`.
fn tracked_addr(i: usize, fresh: bool) -> [u8; 4] {
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
fn census(limiter: &Limiter, rule: u32) -> Result<(u64, u64)> {
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
fn population_addrs(limiter: &Limiter, rule: u32) -> Result<(Vec<[u8; 4]>, Vec<u32>)> {
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
fn key_sets(
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
fn free_fresh(limiter: &Limiter, rule: u32, first: usize, end: usize) -> Result<u64> {
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
fn restore(limiter: &Limiter, rule: u32, addrs: &[[u8; 4]]) -> Result<u64> {
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
fn grow(
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

/// Records of the store for [`populations`]' `in_cache` case: 4 MiB (1,024 pages), so the
/// records a new source's packet reads can stay in the CPU's last-level cache, and its pages
/// mostly in the TLB, where in the default store (64 MiB, 16,384 pages) they are in neither. The
/// same 1k population and the same new sources (each run's 20,000 fit without evicting any, so
/// the program takes the same path as with the default store): the difference between the two
/// stores' new-source figures is what the memory beyond the last-level cache costs. (A store of
/// 8,192 records, all in L2, measured lower still, but there each run's new sources evict one
/// another: another path.)
pub const IN_CACHE_BUCKETS: u32 = 65_536;

/// Tracked-source populations: the hot path, a random known source and a new source, with the
/// bucket store holding each population in turn (grown by running frames through the program,
/// one per source, until `bucket_count` says the store holds it).
///
/// New and random known sources come from drivers that rewrite the frame's source on every run
/// and tail-calls the limiter; the same drivers tail-calling `bench_pass` are their floors. The
/// new sources' buckets are freed again after each run, and sources they pushed out are sent
/// again, so that the population stays what it says.
///
/// With `in_cache`, one population only (1k), in a store of [`IN_CACHE_BUCKETS`] records (see
/// there): tagged `cache`.
///
/// Returns the buckets the store tracked once the last population was grown.
#[expect(clippy::too_many_lines, reason = "one measurement, step by step")]
pub fn populations(
    report: &mut Report,
    opts: &Options,
    refs: &Refs,
    limiter: &Limiter,
    in_cache: bool,
) -> Result<u64> {
    use std::os::fd::AsFd as _;
    let tracked = limiter.id("tracked")?;
    let capacity = limiter.tdp.maps().bucket_capacity()?;
    // Measures new sources (the next addresses after a start): each one's first packet.
    let new_lim = Driver::new("rlb_seq_lim", Sources::Sequential, limiter.program(), refs)?;
    // Its floors: the same driver tail-calling XDP_PASS, and the memory floors (the driver
    // reading one random record of the store, or the 8 records of two sets, before it passes).
    let buckets = pinned(limiter, map_names::BUCKETS)?;
    let record = Some(Touch::Record(buckets.fd().as_fd(), capacity));
    let candidates = Some(Touch::Candidates(buckets.fd().as_fd(), capacity));
    let charged = Some(Touch::ChargedCandidates(buckets.fd().as_fd(), capacity));
    let new_pass = |name: &str, touch: Option<Touch<'_>>| {
        Driver::touching(name, Sources::Sequential, touch, refs.program(PASS), refs)
    };
    let new_floor = new_pass("rlb_seq_pass", None)?;
    let memory_floor = new_pass("rlb_seq_mem", record)?;
    let candidates_floor = new_pass("rlb_seq_mem8", candidates)?;
    let charged_floor = new_pass("rlb_seq_mem8a", charged)?;
    // Opt-in (`--paged-floors`): the same two floors on a store of kmalloc'ed pages.
    let paged = if opts.paged_floors {
        Some(progs::PagedStore::new(capacity)?)
    } else {
        None
    };
    let paged_floors = match &paged {
        Some(paged) => Some((
            new_pass(
                "rlb_seq_pmem",
                Some(Touch::PagedRecord(paged.outer.as_fd(), paged.pages)),
            )?,
            new_pass(
                "rlb_seq_pmem8",
                Some(Touch::PagedCandidates(paged.outer.as_fd(), paged.pages)),
            )?,
        )),
        None => None,
    };
    let mut sent = 0usize;
    let mut fresh_next = 0usize;
    let cap = capacity as usize;
    // (population wanted, most sources sent to get it, tag, label)
    let mut steps: Vec<(u64, usize, &str, &str)> = if in_cache {
        vec![(
            1_000,
            1_000 * 2,
            "cache",
            "1k tracked, a store of 65,536 records (4 MiB)",
        )]
    } else {
        vec![
            (1_000, 1_000 * 2, "1k", "1k tracked"),
            (100_000, 100_000 * 2, "100k", "100k tracked"),
            (1_000_000, cap * 3 / 2, "1m", "1M tracked"),
            // Full: every record holding a source. Near the end a new source finds a free
            // record only when one of its 16 candidates is free (the others recycle refilled
            // buckets), so the last free records take a few million sources to find.
            (u64::from(capacity), cap * 4, "full", "store full, evicting"),
        ]
    };
    if opts.quick {
        steps.truncate(2);
    }
    let mut last = 0;
    let new_repeat = u32::try_from(opts.new_sources).context("--new-sources")?;
    for (target, limit, tag, what) in steps {
        crate::session::check_interrupted()?;
        crate::session::announce(&format!(
            "in-kernel cost with {what} (populating to {target} buckets)"
        ));
        let start = Instant::now();
        let population = grow(limiter, refs, tracked, &mut sent, target, limit)?;
        let fill_secs = start.elapsed().as_secs_f64();
        let count = limiter.tdp.maps().bucket_count()?;
        eprintln!(
            "    {what}: {population} buckets of the population ({sent} sources sent), \
             {count} buckets tracked in all, capacity {capacity}"
        );
        if tag != "full" && population < target {
            bail!("{what}: the store holds only {population} of {target} buckets after {sent} sources");
        }
        // Random known sources are drawn from the addresses that hold a bucket now.
        let (addrs, records) = population_addrs(limiter, tracked)?;
        let (addr_array, n) = progs::turn_array(&addrs)?;
        // The same addresses with their keys' sets: a driver that reads their records first
        // (`Sources::InTurnWarm`), so that the limiter's work at this population is measured
        // apart from its memory.
        let (warm_array, warm_n) =
            progs::turn_array_warm(&key_sets(limiter, tracked, &addrs, &records)?)?;
        let warm_sources = || Sources::InTurnWarm(warm_array.as_fd(), warm_n, buckets.fd().as_fd());
        // `FEW` of them, every k-th record of the store's order, again and again: the store as
        // full as the population makes it, the lines of the sources sent in the last-level cache.
        let few: Vec<[u8; 4]> = addrs
            .iter()
            .step_by((addrs.len() / FEW).max(1))
            .copied()
            .collect();
        let (few_array, few_n) = progs::turn_array(&few)?;
        let known_few = Driver::new(
            "rlb_knownf_lim",
            Sources::InTurn(few_array.as_fd(), few_n),
            limiter.program(),
            refs,
        )?;
        let known_warm = Driver::new("rlb_knownw_lim", warm_sources(), limiter.program(), refs)?;
        let known_warm_floor = Driver::touching(
            "rlb_knownw_pass",
            warm_sources(),
            None,
            refs.program(PASS),
            refs,
        )?;
        let known = Driver::new(
            "rlb_known_lim",
            Sources::InTurn(addr_array.as_fd(), n),
            limiter.program(),
            refs,
        )?;
        // Its floors: the same driver tail-calling XDP_PASS, touching the store or not.
        let known_pass = |name: &str, touch: Option<Touch<'_>>| {
            let sources = Sources::InTurn(addr_array.as_fd(), n);
            Driver::touching(name, sources, touch, refs.program(PASS), refs)
        };
        let known_floor = known_pass("rlb_known_pass", None)?;
        let known_memory_floor = known_pass("rlb_known_mem", record)?;
        let known_candidates_floor = known_pass("rlb_known_mem8", candidates)?;
        let known_charged_floor = known_pass("rlb_known_mem8a", charged)?;
        // The LRU contender on the same addresses, in turns with the limiter (see `lru.rs`);
        // with the store full, all but `SLACK` of them, after as many never-sent ones.
        let mut lru_cases = Vec::new();
        if !in_cache {
            let (held, filler): (&[[u8; 4]], Vec<[u8; 4]>) = if tag == "full" {
                let keep = addrs.len().min(ENTRIES as usize - SLACK);
                let want = ENTRIES as usize - keep;
                let filler = (sent..sent + want).map(|i| tracked_addr(i, false));
                (&addrs[..keep], filler.collect())
            } else {
                (&addrs, Vec::new())
            };
            for kind in [Kind::Shared, Kind::PerCpu] {
                lru_cases.push(LruCase::new(kind, refs, held, &filler)?);
            }
        }

        let (mut memory_floor_ns, mut candidates_floor_ns) = (Vec::new(), Vec::new());
        let (mut paged_floor_ns, mut paged_candidates_floor_ns) = (Vec::new(), Vec::new());
        let (mut known_memory_floor_ns, mut known_candidates_floor_ns) = (Vec::new(), Vec::new());
        let (mut known_charged_floor_ns, mut charged_floor_ns) = (Vec::new(), Vec::new());
        let (mut known_warm_ns, mut known_warm_floor_ns) = (Vec::new(), Vec::new());
        let mut known_few_ns = Vec::new();
        let (mut hot, mut known_ns, mut known_floor_ns, mut new_ns, mut new_floor_ns, mut floor) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
        );
        let (mut known_misses, mut new_created, mut evicted_full, mut evicted_lost, mut resent) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        let (mut new_first, mut new_first_created, mut new_made_ns) = (0, 0, Vec::new());
        let mut population_min = population;
        let hot_frame = v4_frame(addrs[addrs.len() / 2]);
        repeat_ns(limiter.program(), &hot_frame, 10)?;
        let floor_frame = v4_frame([198, 18, 0, 1]);
        let known_frame = v4_frame(tracked_addr(0, false));
        let counter = |i: usize| limiter.tdp.global().counters[i];
        for _ in 0..opts.runs {
            crate::session::check_interrupted()?;
            floor.push(repeat_ns(refs.program(PASS), &floor_frame, opts.repeat)?.0 + TRUNCATION);
            hot.push(repeat_ns(limiter.program(), &hot_frame, opts.repeat)?.0 + TRUNCATION);
            known_floor_ns.push(known_floor.run(&known_frame, opts.repeat)?);
            known_memory_floor_ns.push(known_memory_floor.run(&known_frame, opts.repeat)?);
            known_candidates_floor_ns.push(known_candidates_floor.run(&known_frame, opts.repeat)?);
            known_charged_floor_ns.push(known_charged_floor.run(&known_frame, opts.repeat)?);
            let created = counter(global::NEW_BUCKETS);
            known_ns.push(known.run(&known_frame, opts.repeat)?);
            known_misses += counter(global::NEW_BUCKETS) - created;
            known_warm_floor_ns.push(known_warm_floor.run(&known_frame, opts.repeat)?);
            known_warm_ns.push(known_warm.run(&known_frame, opts.repeat)?);
            known_few_ns.push(known_few.run(&known_frame, opts.repeat)?);
            for c in &mut lru_cases {
                c.run_known(&known_frame, opts.repeat)?;
            }
            let first = fresh_next;
            // The frame every new-source driver of this run starts from.
            let fresh = sequential_from(tracked_addr(first, true));
            new_floor_ns.push(new_floor.run(&fresh, new_repeat)?);
            memory_floor_ns.push(memory_floor.run(&fresh, new_repeat)?);
            candidates_floor_ns.push(candidates_floor.run(&fresh, new_repeat)?);
            charged_floor_ns.push(charged_floor.run(&fresh, new_repeat)?);
            if let Some((one, eight)) = &paged_floors {
                paged_floor_ns.push(one.run(&fresh, new_repeat)?);
                paged_candidates_floor_ns.push(eight.run(&fresh, new_repeat)?);
            }
            let (created, full, lost) = (
                counter(global::NEW_BUCKETS),
                counter(global::EVICTED_FULL),
                counter(global::EVICTED_LOST),
            );
            let first_packets = counter(global::FIRST_PACKETS);
            new_ns.push(new_lim.run(&fresh, new_repeat)?);
            new_first += counter(global::FIRST_PACKETS) - first_packets;
            new_first_created += counter(global::NEW_BUCKETS) - created;
            fresh_next += opts.new_sources;
            // The same over the next new sources, each making its bucket: what a new key's
            // packet costs where its slot of the first-packet table is another's (or its second
            // packet, owing the first).
            let fresh_made = sequential_from(tracked_addr(fresh_next, true));
            let created = counter(global::NEW_BUCKETS);
            new_made_ns.push(limiter.making_buckets(|| new_lim.run(&fresh_made, new_repeat))?);
            new_created += counter(global::NEW_BUCKETS) - created;
            evicted_full += counter(global::EVICTED_FULL) - full;
            evicted_lost += counter(global::EVICTED_LOST) - lost;
            fresh_next += opts.new_sources;
            // Take the new sources out again, and put back the population they pushed out.
            free_fresh(limiter, tracked, first, fresh_next)?;
            let (now, _) = census(limiter, tracked)?;
            population_min = population_min.min(now);
            if now < population {
                resent += restore(limiter, tracked, &addrs)?;
            }
            for c in &mut lru_cases {
                let fresh_addrs = (first..first + opts.new_sources).map(|i| tracked_addr(i, true));
                c.run_new(&fresh, new_repeat, fresh_addrs)?;
            }
        }
        let (population_end, fresh_left) = census(limiter, tracked)?;
        let count_end = limiter.tdp.maps().bucket_count()?;
        // What the store tracked once filled (the runs above free their new sources' records
        // again, so it ends a little below).
        last = count;
        let runs = opts.runs as u64;
        let detail = json!({
            "target_buckets": target,
            "sources_sent": sent,
            "population_buckets": population,
            "population_buckets_min_between_runs": population_min,
            "population_buckets_end": population_end,
            "tracked_buckets": count,
            "tracked_buckets_end": count_end,
            "new_sources_left_end": fresh_left,
            "bucket_capacity": capacity,
            "populate_seconds": fill_secs,
            "random_known_among": n,
            "random_known_new_buckets_per_run": known_misses / runs,
            "new_sources_per_run": opts.new_sources,
            "first_packets_per_new_run": new_first / runs,
            "new_buckets_per_new_run": new_first_created / runs,
            "new_buckets_per_made_run": new_created / runs,
            "evicted_full_per_new_run": evicted_full / runs,
            "evicted_lost_per_new_run": evicted_lost / runs,
            "population_resent_buckets": resent,
        });
        eprintln!(
            "    {what}: random known: {} of {} runs created a bucket per run (pushed out by the \
             previous run's new sources); new sources: {} of {} first packets passed without a \
             bucket; making theirs: {} buckets created, {} refilled and {} in-debt buckets \
             evicted per run",
            known_misses / runs,
            opts.repeat,
            new_first / runs,
            opts.new_sources,
            new_created / runs,
            evicted_full / runs,
            evicted_lost / runs
        );
        let mut add = |key: String, label: String, runs: Vec<f64>, baseline: Option<String>| {
            report.add(Figure {
                key,
                section: SECTION_POP,
                label,
                unit: "ns/pkt",
                runs,
                baseline,
                detail: detail.clone(),
            });
        };
        let what = format!("{what}, {count} in store");
        let k = |what: &str| format!("kernel.pop.{tag}.{what}");
        add(k("floor"), format!("floor: XDP_PASS ({what})"), floor, None);
        add(
            k("hot"),
            format!("limiter: hot known source, {what}"),
            hot,
            Some(k("floor")),
        );
        add(
            k("known_floor"),
            format!("floor: random-known driver + XDP_PASS ({what})"),
            known_floor_ns,
            None,
        );
        add(
            k("known"),
            format!("limiter: random known source (driver), {what}"),
            known_ns,
            Some(k("known_floor")),
        );
        add(
            k("known_warm"),
            format!(
                "limiter: random known source, its 8 records read by the driver first ({what})"
            ),
            known_warm_ns,
            Some(k("known_warm_floor")),
        );
        add(
            k("known_few"),
            format!("limiter: random known source, {FEW} of the population spread over the store ({what})"),
            known_few_ns,
            Some(k("known_floor")),
        );
        add(
            k("new_floor"),
            format!("floor: new-source driver + XDP_PASS ({what})"),
            new_floor_ns,
            None,
        );
        add(
            k("new"),
            format!("limiter: new source, first packet (driver), {what}"),
            new_ns,
            Some(k("new_floor")),
        );
        add(
            k("new_made"),
            format!("limiter: new source making its bucket (driver), {what}"),
            new_made_ns,
            Some(k("new_floor")),
        );
        for (key, driver, runs, floor) in [
            (
                "known_memory_floor",
                "random-known driver reading one random record of the store",
                known_memory_floor_ns,
                "known_floor",
            ),
            (
                "known_candidates_floor",
                "random-known driver reading the 8 records of two random sets of a page",
                known_candidates_floor_ns,
                "known_floor",
            ),
            (
                "known_charged_floor",
                "random-known driver reading the 8 records of two random sets of a page, then \
                 one locked add to one of them",
                known_charged_floor_ns,
                "known_floor",
            ),
            (
                "known_warm_floor",
                "random-known driver reading the source's own 8 records",
                known_warm_floor_ns,
                "known_floor",
            ),
            (
                "new_memory_floor",
                "new-source driver reading one random record of the store",
                memory_floor_ns,
                "new_floor",
            ),
            (
                "new_candidates_floor",
                "new-source driver reading the 8 records of a key's two sets",
                candidates_floor_ns,
                "new_floor",
            ),
            (
                "new_charged_floor",
                "new-source driver reading the 8 records of a key's two sets, then one locked \
                 add to one of them",
                charged_floor_ns,
                "new_floor",
            ),
            (
                "new_paged_memory_floor",
                "new-source driver reading one random record of a store on kmalloc'ed pages",
                paged_floor_ns,
                "new_floor",
            ),
            (
                "new_paged_candidates_floor",
                "new-source driver reading the 8 records of two sets of a store on kmalloc'ed pages",
                paged_candidates_floor_ns,
                "new_floor",
            ),
        ] {
            if runs.is_empty() {
                continue;
            }
            add(
                k(key),
                format!("memory: {driver} ({what})"),
                runs,
                Some(k(floor)),
            );
        }
        for c in lru_cases {
            c.report(report, tag, &what, &detail);
        }
    }
    Ok(last)
}
