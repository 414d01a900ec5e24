//! The bucket census: how many buckets are tracked, counted off the agent's lock.
//!
//! Counting means walking the whole bucket store (up to 2^26 records, 4 GiB): far too slow for
//! `status` or a scrape to do while holding the agent's lock, as they once did. A task of its own
//! walks the store on a blocking thread with its own handles on the pinned maps, and publishes
//! each result with the time its walk began. Readers ([`Census::fresh`]) ask for a walk that
//! begins after their question and wait for it a bounded time ([`FRESH_WAIT`]): a small store is
//! walked in well under a millisecond, so its count is exact right after the traffic that made
//! it; a large one answers with the latest count (and its age) rather than wait.
//!
//! Walks are paced: after a walk that took `d`, the next starts no sooner than `PACE x d` later
//! (so the census costs at most about 1/(PACE+1) of a core however often it is asked), and at the
//! latest [`PERIOD`] (or that pace) later when nobody asks.

use std::{
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use serde::Serialize;
use tokio::sync::{watch, Notify};

use crate::{
    compile::CompiledRuleSet,
    maps::{MapsError, PinnedMaps},
    stats::StatsReport,
};

/// How long a reader waits for a walk that began after its question.
pub const FRESH_WAIT: Duration = Duration::from_millis(30);
/// Walks at least this often while nobody asks (unless pacing forbids).
pub const PERIOD: Duration = Duration::from_secs(1);
/// Pause after a walk, as a multiple of the walk's duration.
const PACE: u32 = 9;

/// One count of the tracked buckets.
#[derive(Clone, Copy, Debug)]
pub struct Reading {
    /// Buckets tracked.
    pub tracked: u64,
    /// When the walk that counted them began.
    pub began: Instant,
    /// How long it took.
    pub took: Duration,
}

impl Reading {
    /// Milliseconds since the walk began (what `status` reports as the count's age).
    #[must_use]
    pub fn age_ms(&self) -> u64 {
        u64::try_from(self.began.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// What `status` reports of the census.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct CensusAge {
    /// Milliseconds since the walk that counted `buckets_tracked` began.
    pub age_ms: u64,
    /// How long that walk took, in microseconds.
    pub walk_us: u64,
}

impl From<&Reading> for CensusAge {
    fn from(r: &Reading) -> Self {
        Self {
            age_ms: r.age_ms(),
            walk_us: u64::try_from(r.took.as_micros()).unwrap_or(u64::MAX),
        }
    }
}

/// The census's readers' handle (cheap to clone).
#[derive(Clone)]
pub struct Census {
    latest: watch::Receiver<Option<Reading>>,
    kick: Arc<Notify>,
}

impl Census {
    /// Starts the census task over `maps` (the caller's own handles on the pinned maps). It runs
    /// until the returned task is aborted.
    #[must_use]
    pub fn spawn(maps: Arc<PinnedMaps>) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = watch::channel(None);
        let kick = Arc::new(Notify::new());
        let task = tokio::spawn(run(maps, tx, kick.clone()));
        (Self { latest: rx, kick }, task)
    }

    /// The latest count, if a walk has finished.
    #[must_use]
    pub fn latest(&self) -> Option<Reading> {
        *self.latest.borrow()
    }

    /// A count from a walk that began after this call, if one finishes within [`FRESH_WAIT`];
    /// else the latest one (waiting, only at start, for the first walk to finish). When the last
    /// walk shows that the next cannot be done within the wait (a large store, or pacing), the
    /// latest count is returned at once.
    pub async fn fresh(&self) -> Reading {
        self.fresh_within(FRESH_WAIT).await
    }

    /// [`Census::fresh`] with another bound on the wait.
    pub async fn fresh_within(&self, wait: Duration) -> Reading {
        let asked = Instant::now();
        self.kick.notify_one();
        // A walk that cannot both begin (pacing) and end within the wait is not waited for.
        if let Some(last) = self.latest() {
            let next_ends = (last.began + last.took * (PACE + 1)).max(asked) + last.took;
            if next_ends > asked + wait {
                return last;
            }
        }
        let mut rx = self.latest.clone();
        let newer = rx.wait_for(|r| r.is_some_and(|r| r.began >= asked));
        if let Ok(Ok(r)) = tokio::time::timeout(wait, newer).await {
            if let Some(r) = *r {
                return r;
            }
        }
        let mut rx = self.latest.clone();
        let first = rx.wait_for(Option::is_some).await;
        match first {
            Ok(r) => r.expect("checked by wait_for"),
            // The census task is gone (the agent is shutting down): nothing counted.
            Err(_) => Reading {
                tracked: 0,
                began: asked,
                took: Duration::ZERO,
            },
        }
    }
}

async fn run(maps: Arc<PinnedMaps>, tx: watch::Sender<Option<Reading>>, kick: Arc<Notify>) {
    let mut warned = false;
    loop {
        let began = Instant::now();
        let walk = maps.clone();
        let Ok(count) = tokio::task::spawn_blocking(move || walk.bucket_count()).await else {
            tracing::error!("bucket census: the walk panicked; census stopped");
            return;
        };
        let took = began.elapsed();
        match count {
            Ok(tracked) => {
                warned = false;
                tx.send_replace(Some(Reading {
                    tracked,
                    began,
                    took,
                }));
            }
            Err(e) => {
                if !warned {
                    tracing::warn!(error = %e, "bucket census: reading the bucket store");
                    warned = true;
                }
            }
        }
        let ended = Instant::now();
        let earliest = ended + took * PACE;
        let latest = ended + PERIOD.max(took * PACE);
        // A question asked during the walk left a permit: it is answered by the next walk,
        // which may begin once the pause is over.
        tokio::select! {
            () = kick.notified() => tokio::time::sleep_until(earliest.into()).await,
            () = tokio::time::sleep_until(latest.into()) => {}
        }
    }
}

/// What the servers read without the agent's lock: their own handles on the pinned maps, the
/// census, and the rules in force.
#[derive(Clone)]
pub struct ReadSide {
    /// Handles on the pinned maps, opened from the pin directory (the agent's stay behind its
    /// lock).
    pub maps: Arc<PinnedMaps>,
    /// The bucket census.
    pub census: Census,
    /// The rules in force ([`crate::agent::Agent::rules_in_force`]).
    pub rules: watch::Receiver<Arc<CompiledRuleSet>>,
}

impl ReadSide {
    /// Opens the maps pinned in `pin_dir` and starts the census over them.
    pub fn start(
        pin_dir: &Path,
        rules: watch::Receiver<Arc<CompiledRuleSet>>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), MapsError> {
        let maps = Arc::new(PinnedMaps::open(pin_dir)?);
        let (census, task) = Census::spawn(maps.clone());
        Ok((
            Self {
                maps,
                census,
                rules,
            },
            task,
        ))
    }

    /// The counters of the program and of the rules in force, with the bucket count of
    /// `census`: a few system calls per rule (run it on a blocking thread).
    pub fn stats(&self, census: &Reading) -> Result<StatsReport, MapsError> {
        let set = self.rules.borrow().clone();
        StatsReport::read_counters(
            &self.maps,
            set.rules
                .iter()
                .map(|r| (r.id, r.name.clone(), u32::try_from(r.line).unwrap_or(0))),
            census.tracked,
        )
    }
}
