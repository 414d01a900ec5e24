//! Limits learned from the traffic (`ratelimit suggest`): per rule and limit, the distribution of
//! what each bucket really sends (passed and dropped: so the same in dry run and live), its peak
//! rate over 1 s and over 10 s and its largest burst, over the last hour and the last day, kept
//! across restarts in the state directory.
//!
//! A task of its own walks the bucket store on a blocking thread, like the census
//! ([`crate::census`]), paced the same way (at most about a tenth of a core) and at most once a
//! second, and follows each bucket's counters ([`track`]). What a bucket did over a 5-minute
//! slot (or its life, if shorter) is one observation, added to its limit's quantile sketches
//! ([`history`]) and offered to its slot's list of heaviest buckets, named by their keys
//! ([`heavy`]); `suggest` reads them ([`suggest`]).
//!
//! Memory is bounded whatever the number of sources: at most [`track::MAX_TRACKED`] buckets
//! followed (a table of 7.6 MiB at most; a uniform sample beyond), and at most [`MAX_LIMITS`]
//! limits learned, each at most 38 slots of three sketches of at most about 5 KiB of bins
//! (typically far less): 64 x 38 x 3 x 5 KiB, 37 MiB at the very worst; and a list of at most
//! [`heavy::HEAVY_K`] heaviest buckets a slot, 64 x 38 x 16 x 48 bytes, 1.9 MiB at most.
//! [`Learner::footprint`] counts what it holds against these.
//!
//! The sketches are DDSketch (`sketches-ddsketch`): a quantile within 2% of a value of the data
//! whatever its distribution, merged exactly (slots into hours, hours into a day), with a
//! compact binary encoding for the state file ([`persist`]).

pub mod heavy;
pub mod history;
pub mod persist;
pub mod suggest;
pub mod track;

#[cfg(test)]
mod tests;

use std::{
    path::PathBuf,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use ratelimit_common::BucketKey;
use tokio::sync::watch;

use self::{
    heavy::Source,
    history::{DAY_SECS, SLOT_SECS},
    persist::Histories,
    suggest::{Proposed, Query, Suggestion},
    track::{rule_of, Observation, Tracker},
};
use crate::{
    compile::CompiledRuleSet,
    maps::{
        bucket::{key_net, monotonic_ns},
        PinnedMaps,
    },
};

/// Most (rule, limit) pairs learned; a rule's limits beyond are not (the rules first in the
/// rule set's order are).
pub const MAX_LIMITS: usize = 64;
/// How often the histories are written to the state directory.
pub const SAVE_EVERY: Duration = Duration::from_secs(60);
/// Walks at most this often.
const PERIOD: Duration = Duration::from_secs(1);
/// Pause after a walk, as a multiple of its duration.
const PACE: u32 = 9;
/// IP protocol number of TCP.
const TCP: u8 = 6;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The learner's state: the histories and the followed buckets.
pub struct Learner {
    histories: Histories,
    tracker: Tracker,
    /// The slot (Unix seconds / [`SLOT_SECS`]) the live buckets' peaks are of.
    slot: u64,
    state_dir: Option<PathBuf>,
    /// Warned that the limit on learned limits was reached.
    full_warned: bool,
}

/// Adds `o` of the bucket keyed `key` to its limit's history, if the rule is in `set` and
/// there is room.
fn record(
    histories: &mut Histories,
    full_warned: &mut bool,
    set: &CompiledRuleSet,
    (key, o, at): (&BucketKey, Observation, u64),
) {
    let (id, limit) = rule_of(key.rule);
    let Some(rule) = set.rule(id) else { return };
    let Some(mask) = rule.rule.limit(limit).map(|l| l.src_mask) else {
        return;
    };
    let name = (rule.name.clone(), limit + 1);
    if !histories.contains_key(&name) && histories.len() >= MAX_LIMITS {
        if !*full_warned {
            tracing::warn!(
                rule = %rule.name,
                "suggest: already learning {MAX_LIMITS} limits; this one is not learned"
            );
            *full_warned = true;
        }
        return;
    }
    let source = Source(key_net(key, &mask));
    histories.entry(name).or_default().add(at, &o, source);
}

impl Learner {
    /// A learner with the history saved in `state_dir`, if any and readable (a file that is
    /// refused is logged, naming it, and the learner starts with none).
    #[must_use]
    pub fn new(state_dir: Option<PathBuf>) -> Self {
        let now = unix_now();
        let histories = match state_dir
            .as_deref()
            .map(|d| (d, persist::read(d, now, MAX_LIMITS)))
        {
            Some((_, Ok(Some(h)))) => {
                tracing::info!(limits = h.len(), "suggest: learned history read back");
                h
            }
            Some((d, Err(e))) => {
                tracing::warn!(
                    file = %persist::path(d).display(),
                    "suggest: refusing the learned-state file ({e}); starting with no history"
                );
                Histories::new()
            }
            _ => Histories::new(),
        };
        Self {
            histories,
            tracker: Tracker::new(),
            slot: now / SLOT_SECS,
            state_dir,
            full_warned: false,
        }
    }

    /// Reads every live record `walk` hands its callback (index, bucket), as a walk at `now_ns`
    /// (`CLOCK_MONOTONIC`) and `unix` (seconds) under `set`.
    pub fn walk(
        &mut self,
        walk: impl FnOnce(&mut dyn FnMut(u32, &ratelimit_common::Bucket)),
        now_ns: u64,
        unix: u64,
        set: &CompiledRuleSet,
    ) {
        let Self {
            histories,
            tracker,
            full_warned,
            ..
        } = self;
        let mut gone = |key: &BucketKey, o| record(histories, full_warned, set, (key, o, unix));
        tracker.begin();
        walk(&mut |i, b| {
            let (id, limit) = rule_of(u32::from(b.rule));
            if set.rule(id).is_some_and(|r| r.rule.limit(limit).is_some()) {
                tracker.read(i, b, now_ns, &mut gone);
            }
        });
        tracker.end(&mut gone);
        self.roll(unix, set);
    }

    /// Ends the live buckets' slot if `unix` is past it, and moves the histories' slots along.
    pub fn roll(&mut self, unix: u64, set: &CompiledRuleSet) {
        let slot = unix / SLOT_SECS;
        if slot != self.slot {
            let at = self.slot * SLOT_SECS;
            let Self {
                histories,
                tracker,
                full_warned,
                ..
            } = self;
            tracker.live(true, &mut |key, o| {
                record(histories, full_warned, set, (key, o, at));
            });
            self.slot = slot;
            // Rules no longer in force are forgotten (their room goes to others).
            self.histories
                .retain(|(name, _), _| set.by_name(name).is_some());
        }
        for h in self.histories.values_mut() {
            h.roll(unix);
        }
    }

    /// The histories with the live buckets' observations so far.
    fn with_live(&mut self, unix: u64, set: &CompiledRuleSet) -> Histories {
        let mut all = self.histories.clone();
        let mut warned = true;
        self.tracker.live(false, &mut |key, o| {
            record(&mut all, &mut warned, set, (key, o, unix));
        });
        all
    }

    /// The suggestions for `query` under `set`, rules in the set's order, limits in order; `Err`
    /// if it names a rule not in force.
    pub fn suggest(
        &mut self,
        set: &CompiledRuleSet,
        query: &Query,
    ) -> Result<Vec<Suggestion>, String> {
        if let Some(name) = &query.rule {
            if set.by_name(name).is_none() {
                return Err(format!("no rule named {name:?} is in force"));
            }
        }
        let unix = unix_now();
        let all = self.with_live(unix, set);
        let scale = 1.0 / self.tracker.sampled().max(1e-9);
        let since = query.since_secs.min(DAY_SECS);
        let mut out = Vec::new();
        for rule in &set.rules {
            if query.rule.as_ref().is_some_and(|n| *n != rule.name) {
                continue;
            }
            for k in 0..4 {
                let Some(limit) = rule.rule.limit(k) else {
                    break;
                };
                let Some(h) = all.get(&(rule.name.clone(), k + 1)) else {
                    continue;
                };
                let dist = h.since(unix, since);
                if dist.count() == 0 {
                    continue;
                }
                let current = (limit.flags & ratelimit_common::rule_flags::PKT_LIMIT != 0
                    && limit.pkt_interval_ns > 0)
                    .then(|| Proposed {
                        rate: 1_000_000_000 / limit.pkt_interval_ns,
                        burst: limit.pkt_tolerance_ns / limit.pkt_interval_ns,
                    });
                let tcp = rule.rule.protocol == TCP;
                out.push(suggest::suggest(
                    (&rule.name, k + 1),
                    &dist,
                    query,
                    (scale, tcp, current),
                ));
            }
        }
        Ok(out)
    }

    /// Writes the histories, with the live buckets' observations so far, to the state
    /// directory (if any); failures are logged.
    pub fn save(&mut self, set: &CompiledRuleSet) {
        let Some(dir) = self.state_dir.clone() else {
            return;
        };
        let unix = unix_now();
        let all = self.with_live(unix, set);
        if let Err(e) = persist::write_atomic(&dir, &persist::encode(&all, unix)) {
            tracing::warn!(
                file = %persist::path(&dir).display(),
                error = %e,
                "suggest: writing the learned state"
            );
        }
    }

    /// Buckets followed now.
    #[must_use]
    pub fn followed(&self) -> usize {
        self.tracker.len()
    }

    /// Limits learned.
    #[must_use]
    pub fn limits(&self) -> usize {
        self.histories.len()
    }

    /// What it holds: the bounds of the module's top, as counted now.
    #[must_use]
    pub fn footprint(&self) -> Footprint {
        let (slots, bins, heavy) = self
            .histories
            .values()
            .map(history::History::size)
            .fold((0, 0, 0), |(s, b, h), (s1, b1, h1)| {
                (s + s1, b + b1, h + h1)
            });
        Footprint {
            followed: self.tracker.len(),
            followed_bytes: self.tracker.bytes(),
            limits: self.histories.len(),
            slots,
            bins,
            heavy,
        }
    }
}

/// What the learner holds ([`Learner::footprint`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footprint {
    /// Buckets followed.
    pub followed: usize,
    /// Bytes of the table that follows them.
    pub followed_bytes: usize,
    /// Limits learned.
    pub limits: usize,
    /// Slots of all their histories (three sketches each).
    pub slots: usize,
    /// Bins of all those sketches (8 bytes each).
    pub bins: usize,
    /// Entries of all their lists of heaviest buckets (at most [`heavy::HEAVY_K`] a slot, of
    /// [`heavy::HEAVY_BYTES`] each).
    pub heavy: usize,
}

/// One learned limit's quantiles over the last hour, as the metrics export them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Gauges {
    /// The rule.
    pub rule: String,
    /// Its limit, 1 its own.
    pub limit: usize,
    /// Sources observed.
    pub sources: u64,
    /// Quantiles 0.5, 0.9 and 0.99 of the 1 s peak rates.
    pub peak_1s: [f64; 3],
    /// The same of the 10 s peak rates.
    pub peak_10s: [f64; 3],
    /// The same of the bursts.
    pub burst: [f64; 3],
}

/// The quantiles [`Gauges`] holds, as labels.
pub const GAUGE_QUANTILES: [&str; 3] = ["0.5", "0.9", "0.99"];

/// The learner shared by its task, the API and the daemon (which saves it at exit).
#[derive(Clone)]
pub struct LearnHandle {
    learner: Arc<Mutex<Learner>>,
    rules: watch::Receiver<Arc<CompiledRuleSet>>,
}

impl LearnHandle {
    /// The suggestions for `query` (a short computation over at most [`MAX_LIMITS`] histories:
    /// call it on a blocking thread).
    pub fn suggest(&self, query: &Query) -> Result<Vec<Suggestion>, String> {
        let set = self.rules.borrow().clone();
        self.learner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .suggest(&set, query)
    }

    /// The quantiles (0.5, 0.9, 0.99) of every learned limit over the last hour, for the
    /// metrics: at most [`MAX_LIMITS`] entries (call it on a blocking thread).
    #[must_use]
    pub fn gauges(&self) -> Vec<Gauges> {
        let q = Query {
            rule: None,
            quantile: 0.99,
            headroom: 1.0,
            since_secs: history::HOUR_SECS,
        };
        let three = |o: &suggest::Quantiles| [o.p50, o.p90, o.p99];
        self.suggest(&q)
            .unwrap_or_default()
            .into_iter()
            .map(|s| Gauges {
                peak_1s: three(&s.observed.peak_1s),
                peak_10s: three(&s.observed.peak_10s),
                burst: three(&s.observed.burst),
                sources: s.sources,
                rule: s.rule,
                limit: s.limit,
            })
            .collect()
    }

    /// Writes the learned state now (at exit).
    pub fn save(&self) {
        let set = self.rules.borrow().clone();
        self.learner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .save(&set);
    }
}

/// Starts the learner over `maps` (its own handles), reading back and saving to `state_dir`.
#[must_use]
pub fn spawn(
    maps: Arc<PinnedMaps>,
    rules: watch::Receiver<Arc<CompiledRuleSet>>,
    state_dir: Option<PathBuf>,
) -> (LearnHandle, tokio::task::JoinHandle<()>) {
    let learner = Arc::new(Mutex::new(Learner::new(state_dir)));
    let handle = LearnHandle { learner, rules };
    let task = tokio::spawn(run(maps, handle.clone()));
    (handle, task)
}

async fn run(maps: Arc<PinnedMaps>, handle: LearnHandle) {
    let mut saved = Instant::now();
    loop {
        let began = Instant::now();
        let (h, m) = (handle.clone(), maps.clone());
        let save = saved.elapsed() >= SAVE_EVERY;
        let done = tokio::task::spawn_blocking(move || {
            let set = h.rules.borrow().clone();
            let mut l = h.learner.lock().unwrap_or_else(PoisonError::into_inner);
            let store = m.store();
            let now_ns = monotonic_ns();
            l.walk(|each| store.for_each(each), now_ns, unix_now(), &set);
            if save {
                l.save(&set);
            }
        })
        .await;
        if done.is_err() {
            tracing::error!("suggest: the walk panicked; learning stopped");
            return;
        }
        if save {
            saved = Instant::now();
        }
        let took = began.elapsed();
        tokio::time::sleep(PERIOD.max(took * PACE)).await;
    }
}
