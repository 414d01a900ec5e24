//! The LRU contender ([`crate::lru`]) at each population of [`super::populations`], in turns
//! with the limiter: its map holds the very addresses the limiter's population holds (all but
//! [`SLACK`] of them when the store is full, and as many never-sent ones in their place), its
//! random known source is drawn by the same driver from an array of the same addresses, its new
//! sources are the same addresses from the same frame, so the limiter's driver floors are its
//! floors too.

use std::os::fd::{AsFd as _, OwnedFd};

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::{populations::SECTION_POP, Driver};
use crate::{
    lru::{Gcra, Kind, Lru, ENTRIES},
    progs::Sources,
    refs::Refs,
    report::{Figure, Report},
};

/// The rate and burst of [`super::BASE_RULES`]' `tracked` rule, which the population's
/// sources meet in the limiter.
const TRACKED_RATE: u64 = 1_000_000_000;

/// Entries of a full map given to never-sent sources, added before the population: the kernel's
/// LRU moves free entries to a CPU's list 128 at a time and pushes out the oldest entries when
/// another CPU's list holds the last free ones, so a map given exactly 2^20 sources loses some
/// (measured: the per-CPU map lost 112, and adding those back pushed out the next oldest, until
/// it had cycled through all 2^20). With these first, what it pushes out is theirs.
pub(super) const SLACK: usize = 4096;

/// One contender at one population: its map, its two drivers and its runs.
pub(super) struct LruCase {
    lru: Lru,
    /// The population it holds, and the never-sent sources before them.
    held: Vec<[u8; 4]>,
    filler: Vec<[u8; 4]>,
    _array: OwnedFd,
    known: Driver,
    new: Driver,
    known_ns: Vec<f64>,
    new_ns: Vec<f64>,
    /// Entries the new sources pushed out, added back after each run.
    re_added: u64,
}

impl LruCase {
    /// The contender `kind` holding `addrs` (its random-known driver draws from them), after
    /// `filler` (added first, so that the map pushes those out first).
    pub(super) fn new(
        kind: Kind,
        refs: &Refs,
        addrs: &[[u8; 4]],
        filler: &[[u8; 4]],
    ) -> Result<Self> {
        let tag = kind.tag();
        let lru = Lru::new(
            &format!("rlb_{tag}"),
            kind,
            ENTRIES,
            Gcra::new(TRACKED_RATE, TRACKED_RATE),
            refs.dir(),
        )?;
        for &a in filler.iter().chain(addrs) {
            crate::session::check_interrupted()?;
            lru.add(a)?;
        }
        // A common LRU pushes out entries before it is full when the free entries wait in
        // another CPU's list: every address the driver draws must be there.
        let missing = lru.add_missing(addrs)?;
        if missing > 0 {
            bail!(
                "{tag}: {missing} of {} population entries did not stay",
                addrs.len()
            );
        }
        // The same addresses as the limiter's driver array: the same floor.
        let array = crate::progs::u32_array(addrs)?;
        let n = u32::try_from(addrs.len())?;
        let known = Driver::new(
            &format!("rlb_{tag}_known"),
            Sources::RandomOf(array.as_fd(), n),
            &lru.program,
            refs,
        )?;
        let new = Driver::new(
            &format!("rlb_{tag}_new"),
            Sources::Sequential,
            &lru.program,
            refs,
        )?;
        Ok(Self {
            lru,
            held: addrs.to_vec(),
            filler: filler.to_vec(),
            _array: array,
            known,
            new,
            known_ns: Vec::new(),
            new_ns: Vec::new(),
            re_added: 0,
        })
    }

    /// One run of the random known source.
    pub(super) fn run_known(&mut self, frame: &[u8], repeat: u32) -> Result<()> {
        self.known_ns.push(self.known.run(frame, repeat)?);
        Ok(())
    }

    /// One run of new sources from `fresh` (the addresses `fresh_addrs`); then they are removed
    /// and the entries they pushed out are added back.
    pub(super) fn run_new(
        &mut self,
        fresh: &[u8],
        repeat: u32,
        fresh_addrs: impl Iterator<Item = [u8; 4]>,
    ) -> Result<()> {
        self.new_ns.push(self.new.run(fresh, repeat)?);
        for a in fresh_addrs {
            self.lru.remove(a)?;
        }
        self.re_added += self.lru.add_missing(&self.held)?;
        self.re_added += self.lru.add_missing(&self.filler)?;
        Ok(())
    }

    /// The figures `kernel.<kind>.known_<tag>` and `kernel.<kind>.new_<tag>`, against the
    /// limiter's driver floors of population `tag`; `detail` is the population's.
    pub(super) fn report(self, report: &mut Report, tag: &str, what: &str, detail: &Value) {
        let kind = self.lru.kind;
        let map = match kind {
            Kind::Shared => "LRU_HASH",
            Kind::PerCpu => "LRU_PERCPU_HASH",
        };
        let runs = self.known_ns.len().max(1) as u64;
        let mut detail = detail.clone();
        let held = self.held.len() + self.filler.len();
        detail["tracked_buckets"] = json!(held);
        detail["lru"] = json!({
            "map": map,
            "max_entries": ENTRIES,
            "entries_held": held,
            "population_entries": self.held.len(),
            "filler_entries": self.filler.len(),
            "re_added_per_new_run": self.re_added / runs,
        });
        for (case, runs, floor, driver) in [
            ("known", self.known_ns, "known_floor", "random known source"),
            ("new", self.new_ns, "new_floor", "new source, first packet"),
        ] {
            report.add(Figure {
                key: format!("kernel.{}.{case}_{tag}", kind.tag()),
                section: SECTION_POP,
                label: format!(
                    "LRU contender ({map} 2^20, GCRA): {driver} (driver), {what}, {held} held"
                ),
                unit: "ns/pkt",
                runs,
                baseline: Some(format!("kernel.pop.{tag}.{floor}")),
                detail: detail.clone(),
            });
        }
    }
}
