//! What [`super::populations`] reports of one population: the facts every figure carries in
//! the JSON, the limiter's figures over their floors and the memory floors'.

use anyhow::Result;
use serde_json::{json, Value};

use super::{store::census, Counts, Grown, MemoryFloors, Runs, Setup, Step, FEW};
use crate::{
    kernel::SECTION_POP,
    report::{Figure, Report},
};

/// The facts every figure of one population carries in the JSON (what was sent and held, the
/// counters per run), read once its runs are done; also printed, as a line for the counters.
pub(super) fn detail(
    setup: &Setup<'_>,
    step: Step,
    sent: usize,
    grown: &Grown,
    n: u32,
    counts: &Counts,
) -> Result<Value> {
    let Setup {
        opts,
        limiter,
        tracked,
        capacity,
        ..
    } = *setup;
    let (target, _, _, what) = step;
    let &Grown {
        population,
        fill_secs,
        count,
    } = grown;
    let (population_end, fresh_left) = census(limiter, tracked)?;
    let count_end = limiter.tdp.maps().bucket_count()?;
    let runs = opts.runs as u64;
    let detail = json!({
        "target_buckets": target,
        "sources_sent": sent,
        "population_buckets": population,
        "population_buckets_min_between_runs": counts.population_min,
        "population_buckets_end": population_end,
        "tracked_buckets": count,
        "tracked_buckets_end": count_end,
        "new_sources_left_end": fresh_left,
        "bucket_capacity": capacity,
        "populate_seconds": fill_secs,
        "random_known_among": n,
        "random_known_new_buckets_per_run": counts.known_misses / runs,
        "new_sources_per_run": opts.new_sources,
        "first_packets_per_new_run": counts.new_first / runs,
        "new_buckets_per_new_run": counts.new_first_created / runs,
        "new_buckets_per_made_run": counts.new_created / runs,
        "evicted_full_per_new_run": counts.evicted_full / runs,
        "evicted_lost_per_new_run": counts.evicted_lost / runs,
        "population_resent_buckets": counts.resent,
    });
    eprintln!(
        "    {what}: random known: {} of {} runs created a bucket per run (pushed out by the \
         previous run's new sources); new sources: {} of {} first packets passed without a \
         bucket; making theirs: {} buckets created, {} refilled and {} in-debt buckets \
         evicted per run",
        counts.known_misses / runs,
        opts.repeat,
        counts.new_first / runs,
        opts.new_sources,
        counts.new_created / runs,
        counts.evicted_full / runs,
        counts.evicted_lost / runs
    );
    Ok(detail)
}

/// Where one population's figures go: rows of [`SECTION_POP`] in ns/pkt, keyed
/// `kernel.pop.{tag}.{name}`, each with the population's `detail`.
pub(super) struct PopFigures<'a> {
    report: &'a mut Report,
    tag: &'a str,
    detail: &'a Value,
}

impl PopFigures<'_> {
    /// The key of this population's figure `what`.
    fn k(&self, what: &str) -> String {
        format!("kernel.pop.{}.{what}", self.tag)
    }

    /// Adds a figure, compared with figure `baseline` if any.
    fn add(&mut self, key: String, label: String, runs: Vec<f64>, baseline: Option<String>) {
        self.report.add(Figure {
            key,
            section: SECTION_POP,
            label,
            unit: "ns/pkt",
            runs,
            baseline,
            detail: self.detail.clone(),
        });
    }
}

/// The limiter's figures at one population (`what`), each beside its floor: the hot path over
/// XDP_PASS, random known sources (cold, warm, [`FEW`]) over their driver's floor, new sources
/// (first packet, making the bucket) over theirs. Returns the memory floors, added next.
pub(super) fn limiter_figures(
    report: &mut Report,
    tag: &str,
    what: &str,
    detail: &Value,
    runs: Runs,
) -> MemoryFloors {
    let mut f = PopFigures {
        report,
        tag,
        detail,
    };
    f.add(
        f.k("floor"),
        format!("floor: XDP_PASS ({what})"),
        runs.floor,
        None,
    );
    f.add(
        f.k("hot"),
        format!("limiter: hot known source, {what}"),
        runs.hot,
        Some(f.k("floor")),
    );
    f.add(
        f.k("known_floor"),
        format!("floor: random-known driver + XDP_PASS ({what})"),
        runs.known_floor_ns,
        None,
    );
    f.add(
        f.k("known"),
        format!("limiter: random known source (driver), {what}"),
        runs.known_ns,
        Some(f.k("known_floor")),
    );
    f.add(
        f.k("known_warm"),
        format!("limiter: random known source, its 8 records read by the driver first ({what})"),
        runs.known_warm_ns,
        Some(f.k("known_warm_floor")),
    );
    f.add(
        f.k("known_few"),
        format!(
            "limiter: random known source, {FEW} of the population spread over the store ({what})"
        ),
        runs.known_few_ns,
        Some(f.k("known_floor")),
    );
    f.add(
        f.k("new_floor"),
        format!("floor: new-source driver + XDP_PASS ({what})"),
        runs.new_floor_ns,
        None,
    );
    f.add(
        f.k("new"),
        format!("limiter: new source, first packet (driver), {what}"),
        runs.new_ns,
        Some(f.k("new_floor")),
    );
    f.add(
        f.k("new_made"),
        format!("limiter: new source making its bucket (driver), {what}"),
        runs.new_made_ns,
        Some(f.k("new_floor")),
    );
    runs.floors
}

/// The memory floors at one population (`what`): what reading records of the store costs a
/// driver before it passes, over the same driver's floor, so that the limiter's figures can be
/// told apart into memory and work. The paged floors only with `--paged-floors`, the layout
/// ones with `--layout-floors`.
pub(super) fn memory_floor_figures(
    report: &mut Report,
    tag: &str,
    what: &str,
    detail: &Value,
    floors: MemoryFloors,
) {
    let mut f = PopFigures {
        report,
        tag,
        detail,
    };
    for (key, driver, runs, floor) in [
        (
            "known_memory_floor",
            "random-known driver reading one random record of the store",
            floors.known_memory_floor_ns,
            "known_floor",
        ),
        (
            "known_candidates_floor",
            "random-known driver reading the 8 records of two random sets of a page",
            floors.known_candidates_floor_ns,
            "known_floor",
        ),
        (
            "known_charged_floor",
            "random-known driver reading the 8 records of two random sets of a page, then \
             one locked add to one of them",
            floors.known_charged_floor_ns,
            "known_floor",
        ),
        (
            "known_warm_floor",
            "random-known driver reading the source's own 8 records",
            floors.known_warm_floor_ns,
            "known_floor",
        ),
        (
            "new_memory_floor",
            "new-source driver reading one random record of the store",
            floors.memory_floor_ns,
            "new_floor",
        ),
        (
            "new_candidates_floor",
            "new-source driver reading the 8 records of a key's two sets",
            floors.candidates_floor_ns,
            "new_floor",
        ),
        (
            "new_charged_floor",
            "new-source driver reading the 8 records of a key's two sets, then one locked \
             add to one of them",
            floors.charged_floor_ns,
            "new_floor",
        ),
        (
            "new_paged_memory_floor",
            "new-source driver reading one random record of a store on kmalloc'ed pages",
            floors.paged_floor_ns,
            "new_floor",
        ),
        (
            "new_paged_candidates_floor",
            "new-source driver reading the 8 records of two sets of a store on kmalloc'ed pages",
            floors.paged_candidates_floor_ns,
            "new_floor",
        ),
        (
            "new_layout64_floor",
            "new-source driver reading words 0 and 2 of the 8 records of two sets of a group, \
             records of 64 bytes packed",
            floors.layout64_floor_ns,
            "new_floor",
        ),
        (
            "new_layout56_floor",
            "new-source driver reading words 0 and 2 of the 8 records of two sets of a group, \
             records of 56 bytes packed",
            floors.layout56_floor_ns,
            "new_floor",
        ),
    ] {
        if runs.is_empty() {
            continue;
        }
        f.add(
            f.k(key),
            format!("memory: {driver} ({what})"),
            runs,
            Some(f.k(floor)),
        );
    }
}
