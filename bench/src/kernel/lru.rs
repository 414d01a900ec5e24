//! The LRU contender ([`crate::lru`]) at each population of [`super::populations`], in turns
//! with the limiter: its map holds the very addresses the limiter's population holds (all but
//! [`SLACK`] of them when the store is full, and as many never-sent ones in their place), its
//! random known source is drawn by the same driver from an array of the same addresses, its new
//! sources are the same addresses from the same frame, so the limiter's driver floors are its
//! floors too.

use std::os::fd::{AsFd as _, OwnedFd};

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::{Driver, SECTION_POP};
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

/// Runs `f` on CPU 0, then puts the thread's CPUs back.
///
/// Everything done to a contender's map runs there: its test runs and the user-space calls that
/// fill it and put back what the new sources pushed out. The kernel's common LRU keeps a list of
/// free entries per CPU, and an entry deleted soon after a CPU's program added it goes back to
/// that CPU's list; adding entries from another CPU then cannot use them and pushes out
/// population entries instead. Measured with the thread free to move: 232,746 entries put back
/// per new-source run of 20,000 with the store full.
fn on_cpu0<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    // SAFETY: a zeroed cpu_set_t is a valid set for sched_getaffinity to fill and for
    // sched_setaffinity to read; both touch only it and the calling thread.
    let saved = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw mut set) != 0 {
            bail!(
                "reading the thread's CPUs: {}",
                std::io::Error::last_os_error()
            );
        }
        set
    };
    crate::generator::pin_to_cpu(0)?;
    let result = f();
    // SAFETY: as above.
    let rc = unsafe {
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw const saved)
    };
    if rc != 0 {
        bail!(
            "putting back the thread's CPUs: {}",
            std::io::Error::last_os_error()
        );
    }
    result
}

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
    /// Population entries missing before each known-source run, and right after each
    /// new-source run (summed over the runs).
    missing_before_known: u64,
    missing_after_new: u64,
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
        let missing = on_cpu0(|| {
            for &a in filler.iter().chain(addrs) {
                crate::session::check_interrupted()?;
                lru.add(a)?;
            }
            // A common LRU pushes out entries before it is full when the free entries wait in
            // another CPU's list: every address the driver draws must be there.
            lru.add_missing(addrs)
        })?;
        if missing > 0 {
            bail!(
                "{tag}: {missing} of {} population entries did not stay",
                addrs.len()
            );
        }
        // The same addresses as the limiter's driver array: the same floor.
        let (array, n) = crate::progs::turn_array(addrs)?;
        let known = Driver::new(
            &format!("rlb_{tag}_known"),
            Sources::InTurn(array.as_fd(), n),
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
            missing_before_known: 0,
            missing_after_new: 0,
        })
    }

    /// One run of the random known source.
    pub(super) fn run_known(&mut self, frame: &[u8], repeat: u32) -> Result<()> {
        self.missing_before_known += self.lru.count_missing(&self.held)?;
        let ns = on_cpu0(|| self.known.run(frame, repeat))?;
        self.known_ns.push(ns);
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
        let (ns, re_added) = on_cpu0(|| {
            let ns = self.new.run(fresh, repeat)?;
            self.missing_after_new += self.lru.count_missing(&self.held)?;
            for a in fresh_addrs {
                self.lru.remove(a)?;
            }
            let held = self.lru.add_missing(&self.held)?;
            Ok((ns, held + self.lru.add_missing(&self.filler)?))
        })?;
        self.new_ns.push(ns);
        self.re_added += re_added;
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
            "population_missing_before_known_run": self.missing_before_known / runs,
            "population_missing_after_new_run": self.missing_after_new / runs,
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
