//! Tracked-source populations, 1k to 1M and a full store: the hot path, a random known source
//! and a new source's first packet with the store holding each population, beside their floors
//! and the memory floors (drivers reading records of the store). `store.rs` holds the census that
//! grows the population, frees each run's new sources and puts back what they pushed out;
//! `figures.rs` what each population's runs report.

use std::{os::fd::OwnedFd, time::Instant};

use anyhow::{bail, Context as _, Result};
use aya::maps::MapData;
use ratelimit_common::{global, map_names};

use super::{
    lru::LruCase, pinned, repeat_ns, sequential_from, v4_frame, Driver, Limiter, TRUNCATION,
};
use crate::{
    kernel::lru::SLACK,
    lru::{Kind, ENTRIES},
    progs::{self, Sources, Touch},
    refs::{Refs, PASS},
    report::Report,
    session::Options,
};

mod figures;
mod store;

use figures::{detail, limiter_figures, memory_floor_figures};
use store::{census, free_fresh, grow, key_sets, population_addrs, restore, tracked_addr};

/// Sources of the population the `known_few` driver sends, spread over the store (one record
/// a page at 1M): their records' lines fit the last-level cache (8 MiB), their pages do not
/// fit the TLB.
const FEW: usize = 16_384;

/// Records of the store for [`populations`]' `in_cache` case: 4 MiB (1,024 pages), so the
/// records a new source's packet reads can stay in the CPU's last-level cache, and its pages
/// mostly in the TLB, where in the default store (64 MiB, 16,384 pages) they are in neither. The
/// same 1k population and the same new sources (each run's 20,000 fit without evicting any, so
/// the program takes the same path as with the default store): the difference between the two
/// stores' new-source figures is what the memory beyond the last-level cache costs. (A store of
/// 8,192 records, all in L2, measured lower still, but there each run's new sources evict one
/// another: another path.)
pub const IN_CACHE_BUCKETS: u32 = 65_536;

/// One population of [`populations`]: the population wanted, the most sources sent to get it,
/// its tag (in the figures' keys) and its label.
type Step = (u64, usize, &'static str, &'static str);

/// What every population's measurement shares, loaded once by [`populations`]: the rule and the
/// store, the records the memory floors read, and the new-source drivers.
struct Setup<'a> {
    opts: &'a Options,
    refs: &'a Refs,
    limiter: &'a Limiter,
    in_cache: bool,
    /// The rule whose sources make the population.
    tracked: u32,
    capacity: u32,
    /// The bucket store, and what the memory floors read of it: one random record, the 8
    /// records of two sets, the same then a locked add.
    buckets: &'a MapData,
    record: Option<Touch<'a>>,
    candidates: Option<Touch<'a>>,
    charged: Option<Touch<'a>>,
    /// The new-source driver tail-calling the limiter, and its floors (see [`populations`]).
    new_lim: Driver,
    new_floor: Driver,
    memory_floor: Driver,
    candidates_floor: Driver,
    charged_floor: Driver,
    paged_floors: Option<(Driver, Driver)>,
    /// The key's 8 records in stores of 64- and 56-byte records (`--layout-floors`).
    layout_floors: Option<(Driver, Driver)>,
    /// Packets a new-source run sends (`--new-sources`).
    new_repeat: u32,
}

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
/// Loads the new-source drivers once, then measures each population in turn ([`population`]).
/// Returns the buckets the store tracked once the last population was grown.
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
    // Opt-in (`--layout-floors`): the key's 8 records with records of 64 and of 56 bytes.
    let layouts = if opts.layout_floors {
        Some((
            progs::LayoutStore::new(capacity, 8)?,
            progs::LayoutStore::new(capacity, 7)?,
        ))
    } else {
        None
    };
    let layout_floors = match &layouts {
        Some((wide, narrow)) => Some((
            new_pass("rlb_seq_lay64", Some(wide.touch()))?,
            new_pass("rlb_seq_lay56", Some(narrow.touch()))?,
        )),
        None => None,
    };
    let new_repeat = u32::try_from(opts.new_sources).context("--new-sources")?;
    let setup = Setup {
        opts,
        refs,
        limiter,
        in_cache,
        tracked,
        capacity,
        buckets: &buckets,
        record,
        candidates,
        charged,
        new_lim,
        new_floor,
        memory_floor,
        candidates_floor,
        charged_floor,
        paged_floors,
        layout_floors,
        new_repeat,
    };
    grow_and_measure(report, &setup)
}

/// Grows the store to each population of [`steps`] in turn and measures it ([`population`]),
/// under the profiler where `--profile` asks (the store at its size only, not the small
/// store's). Returns the buckets the store tracked once the last population was grown.
fn grow_and_measure(report: &mut Report, setup: &Setup<'_>) -> Result<u64> {
    let (opts, in_cache) = (setup.opts, setup.in_cache);
    let recorder = match &opts.profile {
        Some(path) if !in_cache => Some((
            crate::profile::Recorder::start(&path.with_extension("data"))?,
            path,
        )),
        _ => None,
    };
    let (mut sent, mut fresh_next, mut last) = (0usize, 0usize, 0);
    for step in steps(opts, in_cache, setup.capacity) {
        last = population(report, setup, &mut sent, &mut fresh_next, step)?;
    }
    if let Some((recorder, path)) = recorder {
        write_profile(recorder, setup.limiter, path)?;
    }
    Ok(last)
}

/// Stops `recorder` and prints, and writes to `path`, where the limiter's program spent the
/// samples it took, by source line.
fn write_profile(
    recorder: crate::profile::Recorder,
    limiter: &Limiter,
    path: &std::path::Path,
) -> Result<()> {
    use std::os::fd::AsFd as _;
    let samples = recorder.stop()?;
    let lines = crate::profile::Lines::of(limiter.program().fd()?.as_fd())?;
    let (rows, total) = lines.by_line(&samples);
    let text = crate::profile::table(&rows, total, "over the tracked-source populations");
    print!("{text}");
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// The populations measured, smallest first: 1k, 100k, 1M and the store full (each with the
/// most sources sent to grow it, as near capacity most new sources take another's record), or
/// the 1k in the small store alone with `in_cache`; the first two with `--quick`.
fn steps(opts: &Options, in_cache: bool, capacity: u32) -> Vec<Step> {
    let cap = capacity as usize;
    // (population wanted, most sources sent to get it, tag, label)
    let mut steps: Vec<Step> = if in_cache {
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
    steps
}

/// One population, `step`: grows it, loads the random-known-source drivers and the LRU
/// contender on its addresses, runs them all `opts.runs` times, and adds the figures. `sent`
/// (sources of the population sent so far) and `fresh_next` (the next never-seen source) carry
/// over to the next population. Returns the buckets the store tracked once it was grown.
fn population(
    report: &mut Report,
    setup: &Setup<'_>,
    sent: &mut usize,
    fresh_next: &mut usize,
    step: Step,
) -> Result<u64> {
    let (_, _, tag, what) = step;
    let grown = grow_population(setup, sent, step)?;
    let drivers = known_drivers(setup)?;
    let mut lru_cases = lru_cases(setup, tag, &drivers.addrs, *sent)?;
    let runs = measure(
        setup,
        &drivers,
        &mut lru_cases,
        fresh_next,
        grown.population,
    )?;
    let detail = detail(setup, step, *sent, &grown, drivers.n, &runs.counts)?;
    let what = format!("{what}, {count} in store", count = grown.count);
    let floors = limiter_figures(report, tag, &what, &detail, runs);
    memory_floor_figures(report, tag, &what, &detail, floors);
    for c in lru_cases {
        c.report(report, tag, &what, &detail);
    }
    // What the store tracked once filled (the runs free their new sources' records again, so
    // it ends a little below).
    Ok(grown.count)
}

/// A population as grown: its live buckets, the seconds it took, and the buckets the store
/// tracked in all.
struct Grown {
    population: u64,
    fill_secs: f64,
    count: u64,
}

/// Grows the population of `step` (see [`grow`]) and says how far it got: the figures are those
/// of a store holding it, so a population short of its target fails (but for the full store,
/// which the last free records keep short).
fn grow_population(setup: &Setup<'_>, sent: &mut usize, step: Step) -> Result<Grown> {
    let Setup {
        refs,
        limiter,
        tracked,
        capacity,
        ..
    } = *setup;
    let (target, limit, tag, what) = step;
    crate::session::check_interrupted()?;
    crate::session::announce(&format!(
        "in-kernel cost with {what} (populating to {target} buckets)"
    ));
    let start = Instant::now();
    let population = grow(limiter, refs, tracked, sent, target, limit)?;
    let fill_secs = start.elapsed().as_secs_f64();
    let count = limiter.tdp.maps().bucket_count()?;
    eprintln!(
        "    {what}: {population} buckets of the population ({sent} sources sent), \
         {count} buckets tracked in all, capacity {capacity}"
    );
    if tag != "full" && population < target {
        bail!("{what}: the store holds only {population} of {target} buckets after {sent} sources");
    }
    Ok(Grown {
        population,
        fill_secs,
        count,
    })
}

/// The random-known-source drivers of one population, with the address arrays they send from
/// (kept for as long as the drivers).
struct KnownDrivers {
    /// The population's addresses that held a bucket once it was grown, and how many.
    addrs: Vec<[u8; 4]>,
    n: u32,
    /// Random known sources, tail-calling the limiter; its floors, tail-calling XDP_PASS.
    known: Driver,
    known_floor: Driver,
    known_memory_floor: Driver,
    known_candidates_floor: Driver,
    known_charged_floor: Driver,
    /// The same sources, their 8 records read first: the limiter, and its floor.
    known_warm: Driver,
    known_warm_floor: Driver,
    /// [`FEW`] of the sources, spread over the store, tail-calling the limiter.
    known_few: Driver,
    _arrays: [OwnedFd; 3],
}

/// Loads the random-known-source drivers of the population the store holds now: drawn from the
/// addresses that hold a bucket, so that each run's source is a known one; with their keys'
/// sets read first, to tell the limiter's work from its memory; and [`FEW`] of them, whose
/// records fit the last-level cache.
fn known_drivers(setup: &Setup<'_>) -> Result<KnownDrivers> {
    use std::os::fd::AsFd as _;
    let Setup {
        refs,
        limiter,
        tracked,
        buckets,
        record,
        candidates,
        charged,
        ..
    } = *setup;
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
    Ok(KnownDrivers {
        addrs,
        n,
        known,
        known_floor,
        known_memory_floor,
        known_candidates_floor,
        known_charged_floor,
        known_warm,
        known_warm_floor,
        known_few,
        _arrays: [addr_array, warm_array, few_array],
    })
}

/// The LRU contender on the same addresses, in turns with the limiter (see `lru.rs`); with the
/// store full, all but `SLACK` of them, after as many never-sent ones (from `sent` on). None
/// with the small store (`in_cache`).
fn lru_cases(setup: &Setup<'_>, tag: &str, addrs: &[[u8; 4]], sent: usize) -> Result<Vec<LruCase>> {
    let Setup { refs, in_cache, .. } = *setup;
    let mut lru_cases = Vec::new();
    if !in_cache {
        let (held, filler): (&[[u8; 4]], Vec<[u8; 4]>) = if tag == "full" {
            let keep = addrs.len().min(ENTRIES as usize - SLACK);
            let want = ENTRIES as usize - keep;
            let filler = (sent..sent + want).map(|i| tracked_addr(i, false));
            (&addrs[..keep], filler.collect())
        } else {
            (addrs, Vec::new())
        };
        for kind in [Kind::Shared, Kind::PerCpu] {
            lru_cases.push(LruCase::new(kind, refs, held, &filler)?);
        }
    }
    Ok(lru_cases)
}

/// Every run's ns/pkt of one population (a value a run), and the counters read around the runs.
#[derive(Default)]
struct Runs {
    /// XDP_PASS alone, and the limiter on one known source again and again (the hot path).
    floor: Vec<f64>,
    hot: Vec<f64>,
    /// The random-known-source drivers: their floor, the limiter, the limiter with the source's
    /// records read first, and the limiter on [`FEW`] sources.
    known_floor_ns: Vec<f64>,
    known_ns: Vec<f64>,
    known_warm_ns: Vec<f64>,
    known_few_ns: Vec<f64>,
    /// The new-source drivers: their floor, the limiter on first packets, and the limiter with
    /// each new source making its bucket.
    new_floor_ns: Vec<f64>,
    new_ns: Vec<f64>,
    new_made_ns: Vec<f64>,
    /// The memory floors.
    floors: MemoryFloors,
    /// See [`Counts`].
    counts: Counts,
}

/// The memory floors of one population, every run's ns/pkt: drivers reading records of the
/// store (or of a store on kmalloc'ed pages, with `--paged-floors`, else empty) before they pass.
#[derive(Default)]
struct MemoryFloors {
    known_memory_floor_ns: Vec<f64>,
    known_candidates_floor_ns: Vec<f64>,
    known_charged_floor_ns: Vec<f64>,
    known_warm_floor_ns: Vec<f64>,
    memory_floor_ns: Vec<f64>,
    candidates_floor_ns: Vec<f64>,
    charged_floor_ns: Vec<f64>,
    paged_floor_ns: Vec<f64>,
    paged_candidates_floor_ns: Vec<f64>,
    layout64_floor_ns: Vec<f64>,
    layout56_floor_ns: Vec<f64>,
}

/// The program's counters read around one population's runs (sums over the runs), and what
/// keeping the population cost: its fewest buckets between runs, and the buckets put back.
#[derive(Default)]
struct Counts {
    /// Buckets the random-known-source runs created (sources pushed out by the previous run).
    known_misses: u64,
    /// First packets passed without a bucket, and buckets created, by the new-source runs.
    new_first: u64,
    new_first_created: u64,
    /// Buckets created, and refilled and in-debt buckets evicted, by the making-buckets runs.
    new_created: u64,
    evicted_full: u64,
    evicted_lost: u64,
    population_min: u64,
    resent: u64,
}

/// The frames of one population's runs: the hot source's, the floor's (a source no rule
/// tracks), and the one the random-known-source drivers rewrite.
struct Frames {
    hot_frame: Vec<u8>,
    floor_frame: Vec<u8>,
    known_frame: Vec<u8>,
}

/// Runs one population `opts.runs` times, each run the known sources then the new sources
/// ([`Runs::known_sources`], [`Runs::new_sources`]), after one warm-up of the hot path.
fn measure(
    setup: &Setup<'_>,
    drivers: &KnownDrivers,
    lru_cases: &mut Vec<LruCase>,
    fresh_next: &mut usize,
    population: u64,
) -> Result<Runs> {
    let Setup { opts, limiter, .. } = *setup;
    let addrs = &drivers.addrs;
    let mut runs = Runs {
        counts: Counts {
            population_min: population,
            ..Counts::default()
        },
        ..Runs::default()
    };
    let hot_frame = v4_frame(addrs[addrs.len() / 2]);
    repeat_ns(limiter.program(), &hot_frame, 10)?;
    let floor_frame = v4_frame([198, 18, 0, 1]);
    let known_frame = v4_frame(tracked_addr(0, false));
    let frames = Frames {
        hot_frame,
        floor_frame,
        known_frame,
    };
    for _ in 0..opts.runs {
        crate::session::check_interrupted()?;
        runs.known_sources(setup, drivers, lru_cases, &frames)?;
        runs.new_sources(setup, addrs, lru_cases, fresh_next, population)?;
    }
    Ok(runs)
}

impl Runs {
    /// One run of the known sources: XDP_PASS, the hot path, the random-known-source floors,
    /// the limiter on random known sources (counting the buckets it had to make: sources the
    /// previous run's new sources pushed out), on them warm, on [`FEW`] of them, then the LRU
    /// contender on the same sources.
    fn known_sources(
        &mut self,
        setup: &Setup<'_>,
        drivers: &KnownDrivers,
        lru_cases: &mut Vec<LruCase>,
        frames: &Frames,
    ) -> Result<()> {
        let Setup {
            opts,
            refs,
            limiter,
            ..
        } = *setup;
        let Frames {
            hot_frame,
            floor_frame,
            known_frame,
        } = frames;
        let counter = |i: usize| limiter.tdp.global().counters[i];
        self.floor
            .push(repeat_ns(refs.program(PASS), floor_frame, opts.repeat)?.0 + TRUNCATION);
        self.hot
            .push(repeat_ns(limiter.program(), hot_frame, opts.repeat)?.0 + TRUNCATION);
        self.known_floor_ns
            .push(drivers.known_floor.run(known_frame, opts.repeat)?);
        self.floors
            .known_memory_floor_ns
            .push(drivers.known_memory_floor.run(known_frame, opts.repeat)?);
        self.floors.known_candidates_floor_ns.push(
            drivers
                .known_candidates_floor
                .run(known_frame, opts.repeat)?,
        );
        self.floors
            .known_charged_floor_ns
            .push(drivers.known_charged_floor.run(known_frame, opts.repeat)?);
        let created = counter(global::NEW_BUCKETS);
        self.known_ns
            .push(drivers.known.run(known_frame, opts.repeat)?);
        self.counts.known_misses += counter(global::NEW_BUCKETS) - created;
        self.floors
            .known_warm_floor_ns
            .push(drivers.known_warm_floor.run(known_frame, opts.repeat)?);
        self.known_warm_ns
            .push(drivers.known_warm.run(known_frame, opts.repeat)?);
        self.known_few_ns
            .push(drivers.known_few.run(known_frame, opts.repeat)?);
        for c in lru_cases {
            c.run_known(known_frame, opts.repeat)?;
        }
        Ok(())
    }

    /// One run of new sources, from `fresh_next` on: the new-source floors, the limiter on
    /// their first packets, then on the next as many each making its bucket (counting what that
    /// created and evicted); then frees them again, puts back the population (`addrs`) they
    /// pushed out, and runs the LRU contender on the same new sources.
    fn new_sources(
        &mut self,
        setup: &Setup<'_>,
        addrs: &[[u8; 4]],
        lru_cases: &mut Vec<LruCase>,
        fresh_next: &mut usize,
        population: u64,
    ) -> Result<()> {
        let Setup {
            opts,
            limiter,
            tracked,
            new_repeat,
            ..
        } = *setup;
        let counter = |i: usize| limiter.tdp.global().counters[i];
        let first = *fresh_next;
        // The frame every new-source driver of this run starts from.
        let fresh = sequential_from(tracked_addr(first, true));
        self.new_floor_ns
            .push(setup.new_floor.run(&fresh, new_repeat)?);
        self.floors
            .memory_floor_ns
            .push(setup.memory_floor.run(&fresh, new_repeat)?);
        self.floors
            .candidates_floor_ns
            .push(setup.candidates_floor.run(&fresh, new_repeat)?);
        self.floors
            .charged_floor_ns
            .push(setup.charged_floor.run(&fresh, new_repeat)?);
        if let Some((one, eight)) = &setup.paged_floors {
            self.floors
                .paged_floor_ns
                .push(one.run(&fresh, new_repeat)?);
            self.floors
                .paged_candidates_floor_ns
                .push(eight.run(&fresh, new_repeat)?);
        }
        if let Some((wide, narrow)) = &setup.layout_floors {
            // In turns: each first in every other run.
            let (w, n) = if self.floors.layout64_floor_ns.len().is_multiple_of(2) {
                let w = wide.run(&fresh, new_repeat)?;
                (w, narrow.run(&fresh, new_repeat)?)
            } else {
                let n = narrow.run(&fresh, new_repeat)?;
                (wide.run(&fresh, new_repeat)?, n)
            };
            self.floors.layout64_floor_ns.push(w);
            self.floors.layout56_floor_ns.push(n);
        }
        let (created, full, lost) = (
            counter(global::NEW_BUCKETS),
            counter(global::EVICTED_FULL),
            counter(global::EVICTED_LOST),
        );
        let first_packets = counter(global::FIRST_PACKETS);
        self.new_ns.push(setup.new_lim.run(&fresh, new_repeat)?);
        self.counts.new_first += counter(global::FIRST_PACKETS) - first_packets;
        self.counts.new_first_created += counter(global::NEW_BUCKETS) - created;
        *fresh_next += opts.new_sources;
        // The same over the next new sources, each making its bucket: what a new key's
        // packet costs where its line's first-packet slots are others' (or its second
        // packet, owing the first).
        let fresh_made = sequential_from(tracked_addr(*fresh_next, true));
        let created = counter(global::NEW_BUCKETS);
        self.new_made_ns
            .push(limiter.making_buckets(|| setup.new_lim.run(&fresh_made, new_repeat))?);
        self.counts.new_created += counter(global::NEW_BUCKETS) - created;
        self.counts.evicted_full += counter(global::EVICTED_FULL) - full;
        self.counts.evicted_lost += counter(global::EVICTED_LOST) - lost;
        *fresh_next += opts.new_sources;
        // Take the new sources out again, and put back the population they pushed out.
        free_fresh(limiter, tracked, first, *fresh_next)?;
        let (now, _) = census(limiter, tracked)?;
        self.counts.population_min = self.counts.population_min.min(now);
        if now < population {
            self.counts.resent += restore(limiter, tracked, addrs)?;
        }
        for c in lru_cases {
            let fresh_addrs = (first..first + opts.new_sources).map(|i| tracked_addr(i, true));
            c.run_new(&fresh, new_repeat, fresh_addrs)?;
        }
        Ok(())
    }
}
