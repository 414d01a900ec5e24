//! This host's demand per key: the buckets read every round, each key's demand counter and
//! its readings' window, and the figures published at the last few syncs.

use std::collections::HashMap;

use std::ops::ControlFlow;

use chitchat::ChitchatId;
use ratelimit_common::{BUCKET_PAGE_RECORDS, SHARE_FIELD_BITS};

use super::{rules::ClusterRules, StoreSide};
use crate::{
    cluster::{
        publish::{candidate_rate, BucketObs, Heaviest, KeyName},
        remote::{DemandWindow, RemoteTracker},
        shares::OwnFigures,
        timing::Timing,
    },
    maps::{
        bucket::{limit_bucket_key, monotonic_ns},
        locator::Locator,
    },
};

/// Demand per key, packets per second.
pub(super) type Demand = HashMap<KeyName, f64>;

/// One key's demand here: its bucket's life (`created_ns`), the raw 32-bit counter last read,
/// the count since it was first read, and the readings' window.
#[derive(Debug, Default)]
pub(super) struct LocalDemand {
    pub(super) created_ns: u64,
    raw: u64,
    count: u64,
    window: DemandWindow,
}

/// Folds the buckets read at `now_ns` into `known` and returns this host's demand per key
/// (packets that reached the bucket, admitted or dropped, per second) over its last
/// [`DEMAND_ROUNDS`] readings, a bursty key's over its last `span_ns`. Only keys read at least
/// twice in the same life of their bucket, or whose bucket was created since `last_ns` (the readings
/// before: its counters start at its creation), have one: for the others this host cannot
/// tell, and their bucket keeps its whole refill (fail open). Keys not read for `forget_ns` are
/// forgotten.
///
/// [`DEMAND_ROUNDS`]: crate::cluster::remote::DEMAND_ROUNDS
fn local_demand(
    known: &mut HashMap<KeyName, LocalDemand>,
    now_ns: u64,
    last_ns: u64,
    seen: &HashMap<KeyName, BucketObs>,
    forget_ns: u64,
    span_ns: u64,
) -> Demand {
    for (k, b) in seen {
        let d = known.entry(k.clone()).or_default();
        if d.created_ns != b.created_ns {
            *d = LocalDemand {
                created_ns: b.created_ns,
                raw: b.demand(),
                ..LocalDemand::default()
            };
            if b.created_ns > last_ns && b.created_ns < now_ns {
                // Born since the last readings: all it counted is demand since then, read over
                // the time since those readings, as the peers read it through gossip (since
                // this host's sync before).
                d.raw = 0;
                d.window.push(last_ns, 0);
            }
        }
        #[expect(clippy::cast_possible_truncation, reason = "32-bit counters")]
        if let Some(gained) = ratelimit_common::counter_advance(b.demand() as u32, d.raw as u32) {
            d.raw = b.demand();
            d.count += u64::from(gained);
        }
        d.window.push(now_ns, d.count);
    }
    known.retain(|k, d| {
        seen.contains_key(k)
            || d.window
                .last_at()
                .is_some_and(|t| now_ns.saturating_sub(t) <= forget_ns)
    });
    seen.keys()
        .filter_map(|k| {
            let r = known.get(k)?.window.rate(1e9, span_ns);
            Some((k.clone(), r)).filter(|_| known[k].window.len() >= 2)
        })
        .collect()
}

impl StoreSide {
    /// Reads the buckets (the published keys', the new keys' and a slice of a walk of the whole
    /// store) and returns the keys to set and delete.
    fn observe(
        &mut self,
        rules: &ClusterRules,
        timing: Timing,
    ) -> (Vec<(String, String)>, Vec<String>, Demand) {
        let now = monotonic_ns();
        let mut seen: HashMap<KeyName, BucketObs> = HashMap::new();
        if let Ok(locator) = Locator::new(&self.maps) {
            for name in self.local.keys() {
                if let Some(b) = read_key(&locator, rules, name) {
                    seen.insert(name.clone(), obs(&b));
                }
            }
        }
        // The new pages and the walk share one budget, a quarter of a sync interval from the
        // round's start, half each while a walk is under way, at least a sixteenth each: under
        // a flood of new keys both always have work, and a round that read both for a quarter
        // each, then its keys' buckets twice, ran a whole interval and more (debug agents on 2
        // cores, 20,000 new keys a second at each host: rounds 130-480 ms late).
        let budget = Budget::new(now, timing.interval_ns());
        let walking = self.walk.is_some() || now >= self.next_full_ns;
        let pages_until = budget.pages_until(monotonic_ns(), walking);
        let mut candidates = self.new_keys(rules, now, pages_until);
        let walk_until = budget.walk_until(monotonic_ns());
        let walked = self.walk_slice(rules, now, timing, walk_until);
        // Candidates chosen from, after a walk of the store or on new keys.
        let choose = walked.is_some() || !candidates.is_empty();
        candidates.extend(walked.unwrap_or_default());
        if let Ok(locator) = Locator::new(&self.maps) {
            for name in candidates {
                if let Some(b) = read_key(&locator, rules, &name) {
                    seen.insert(name, obs(&b));
                }
            }
        }
        self.local.update(now, &seen, choose);
        // The new pages and the walk read every key worth tracking (bounded by `max_keys`
        // twice over); keys not read keep their readings for a while.
        let demand = local_demand(
            &mut self.demand,
            now,
            self.last_observed_ns,
            &seen,
            timing.forget_ns(),
            timing.demand_span_ns(),
        );
        self.last_observed_ns = now;
        let (set, deleted) = self.local.changes();
        (set, deleted, demand)
    }

    /// The keys new since the last round, in the pages the program flagged when it created their
    /// buckets: found at the next round, not at the next walk of the whole store (seconds away
    /// for millions of buckets, while every host holding the key refilled it at its whole rate,
    /// past docs/cluster.md's bound). At most `max_keys`, the heaviest. The pages are read until
    /// `deadline` (the round's [`Budget`]): under a flood of new keys (every page flagged every
    /// round) the rest wait for the next rounds, in store order, rather than holding up this one
    /// past the shares' lapse.
    ///
    /// Before the pages, the records the program left in the grown slots (their count just
    /// passed a power of two), whatever the pages' pass: a heavy key hidden among a flood's new
    /// keys is found at the next round all the same (at most [`GROWN_SLOTS`] records a round).
    ///
    /// [`GROWN_SLOTS`]: ratelimit_common::GROWN_SLOTS
    fn new_keys(&mut self, rules: &ClusterRules, now: u64, deadline: u64) -> Vec<KeyName> {
        let mut heaviest = Heaviest::new(self.local.max_keys());
        let grown = self.maps.new_pages().take_grown();
        let read = self
            .maps
            .for_each_bucket_at(grown.into_iter().map(|(i, _)| i), |_, b| {
                self.offer(rules, &mut heaviest, now, b);
            });
        if let Err(e) = read {
            tracing::warn!(error = %e, "cluster sync: reading the grown keys' buckets");
        }
        if self.pages.next == 0 {
            self.pages.began = now;
        }
        // A bucket created before the last complete pass over the flags began was flagged
        // before it took them (the program flags right after creating); the page's other
        // buckets were there for an earlier pass or walk to find (the creation time is kept to
        // 2^22 ns).
        let since = self.pages.since;
        let stopped = self.maps.new_pages().take_from(
            self.pages.next,
            || monotonic_ns() < deadline,
            |first| {
                let page = first..first.saturating_add(BUCKET_PAGE_RECORDS);
                let read = self.maps.for_each_bucket_in(page, |_, b| {
                    if b.created_ns().saturating_add(1 << SHARE_FIELD_BITS) >= since {
                        self.offer(rules, &mut heaviest, now, b);
                    }
                    ControlFlow::Continue(())
                });
                if let Err(e) = read {
                    tracing::warn!(error = %e, "cluster sync: reading the new keys' buckets");
                }
            },
        );
        match stopped {
            Some(w) => self.pages.next = w,
            None => {
                self.pages.next = 0;
                self.pages.since = self.pages.began;
            }
        }
        heaviest.into_candidates().map(|(k, _)| k).collect()
    }

    /// Offers bucket `b` to `heaviest` if it is of a cluster-scoped limit, not published, and
    /// took packets.
    fn offer(
        &self,
        rules: &ClusterRules,
        heaviest: &mut Heaviest,
        now: u64,
        b: &ratelimit_common::Bucket,
    ) {
        if b.passed_pkts == 0 && b.dropped_pkts == 0 {
            return;
        }
        if let Some(key) = rules.key_of(b) {
            if !self.local.is_published(&key) {
                heaviest.offer(candidate_rate(now, &obs(b)), key, obs(b));
            }
        }
    }

    /// The next slice of the walk of the whole store that finds the heaviest keys not published
    /// (at most `max_keys`, streamed, whatever the size of the store), if one is due or under
    /// way: until `deadline` (the round's [`Budget`]), so that a long walk (a second and more
    /// for millions of buckets) never holds up a round, whose shares lapse three sync intervals
    /// after the last (every bucket at its whole rate). The keys once the walk is
    /// done, else `None`. A walk whose slices took `d` in all waits `10 x d` after it before
    /// the next: at most about a tenth of a core.
    fn walk_slice(
        &mut self,
        rules: &ClusterRules,
        now: u64,
        timing: Timing,
        deadline: u64,
    ) -> Option<Vec<KeyName>> {
        let mut walk = match self.walk.take() {
            Some(w) => w,
            None if now >= self.next_full_ns => Walk {
                next: 0,
                heaviest: Heaviest::new(self.local.max_keys()),
                busy_ns: 0,
            },
            None => return None,
        };
        let began = monotonic_ns();
        let mut n = 0u32;
        let records = self.maps.store().records();
        let scan = self.maps.for_each_bucket_in(walk.next..records, |_, b| {
            n = n.wrapping_add(1);
            if n.is_multiple_of(4096) && monotonic_ns() >= deadline {
                return ControlFlow::Break(());
            }
            self.offer(rules, &mut walk.heaviest, now, b);
            ControlFlow::Continue(())
        });
        walk.busy_ns = walk
            .busy_ns
            .saturating_add(monotonic_ns().saturating_sub(began));
        match scan {
            Ok(end) if end < records => {
                walk.next = end;
                self.walk = Some(walk);
                None
            }
            done => {
                if let Err(e) = done {
                    tracing::warn!(error = %e, "cluster sync: reading the buckets");
                }
                self.next_full_ns =
                    now.saturating_add(timing.interval_ns().max(walk.busy_ns.saturating_mul(10)));
                Some(walk.heaviest.into_candidates().map(|(k, _)| k).collect())
            }
        }
    }
}

/// A round's time for the new pages and the walk of the store (see [`StoreSide::observe`]).
#[derive(Clone, Copy, Debug)]
struct Budget {
    /// A quarter of a sync interval after the round began.
    end: u64,
    /// The least each of the two gets, however late it starts: a sixteenth of an interval.
    least: u64,
}

impl Budget {
    fn new(round_began: u64, interval_ns: u64) -> Self {
        Self {
            end: round_began.saturating_add(interval_ns / 4),
            least: interval_ns / 16,
        }
    }

    /// When the pass over the new pages, starting at `now`, stops: half of what is left while a
    /// walk is under way (`walking`), else all of it.
    fn pages_until(self, now: u64, walking: bool) -> u64 {
        let left = self.end.saturating_sub(now);
        let mine = if walking { left / 2 } else { left };
        now.saturating_add(mine.max(self.least))
    }

    /// When the walk's slice, starting at `now`, stops.
    fn walk_until(self, now: u64) -> u64 {
        self.end.max(now.saturating_add(self.least))
    }
}

/// Where the passes over the new pages' flags are (see [`StoreSide::new_keys`]).
#[derive(Debug)]
pub(super) struct PagesPass {
    /// The word the pass goes on from (0: a new pass).
    next: u32,
    /// When the pass under way began.
    began: u64,
    /// When the last complete pass began: the buckets to read are those created since.
    since: u64,
}

impl PagesPass {
    /// Before the first pass of an agent started at `start_ns`.
    pub(super) fn new(start_ns: u64) -> Self {
        Self {
            next: 0,
            began: start_ns,
            since: start_ns,
        }
    }
}

/// A walk of the whole store under way (see [`StoreSide::walk_slice`]).
pub(super) struct Walk {
    /// The record it goes on from.
    next: u32,
    /// The heaviest keys not published it found so far.
    heaviest: Heaviest,
    /// Its slices' time so far.
    busy_ns: u64,
}

/// The bucket of key `name` now, if it has one.
fn read_key(
    locator: &Locator<'_>,
    rules: &ClusterRules,
    name: &KeyName,
) -> Option<ratelimit_common::Bucket> {
    let (id, rule, _) = rules.limit_of(name)?;
    let key = limit_bucket_key(id, rule, usize::from(name.limit), name.addr);
    locator.bucket(&key).ok().flatten()
}

/// What a round reads of a bucket.
fn obs(b: &ratelimit_common::Bucket) -> BucketObs {
    BucketObs {
        created_ns: b.created_ns(),
        passed_pkts: u64::from(b.passed_pkts),
        passed_bytes: b.passed_bytes,
        dropped_pkts: u64::from(b.dropped_pkts),
    }
}

/// [`StoreSide::observe`] on a blocking thread: the state back, the keys to set and delete and
/// this host's fresh demand; `None` (logged) if the scan panicked.
pub(super) async fn observe_off_thread(
    mut b: StoreSide,
    rules_for_scan: ClusterRules,
    timing: Timing,
) -> Option<(StoreSide, Vec<(String, String)>, Vec<String>, Demand)> {
    let joined = tokio::task::spawn_blocking(move || {
        let (set, deleted, demand) = b.observe(&rules_for_scan, timing);
        (b, set, deleted, demand)
    })
    .await;
    let Ok((b, set, deleted, fresh_demand)) = joined else {
        tracing::error!("cluster sync: the bucket scan panicked; cluster sync stopped");
        return None;
    };
    Some((b, set, deleted, fresh_demand))
}

/// This host's demand to divide by this round, as of the oldest counted peer's sync (see
/// [`OwnFigures::to_divide_by`]), with `fresh_demand` recorded as this round's figures.
pub(super) fn own_demand(
    own_figures: &mut OwnFigures,
    remote: &RemoteTracker<ChitchatId>,
    now: u64,
    unix_ms: u64,
    fresh_demand: Demand,
) -> Demand {
    // Every host divides by the same figures: its own demand as its peers read it, no
    // newer than the figures it reads of them (the oldest counted peer's sync), not its
    // fresher reading. Shares computed from one vector add up to 1 whatever noise the
    // figures carry; with a fresher figure for itself than for the others, each host's
    // error is its own and they add up (1.25 x the budget at 8 hosts, even split, with
    // its own freshest reading).
    let oldest_peer = remote
        .info(now)
        .filter(|(_, i)| i.counted)
        .filter_map(|(_, i)| i.published_unix_ms)
        .min();
    own_figures.to_divide_by(unix_ms, fresh_demand, oldest_peer)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::{local_demand, Budget, KeyName};
    use crate::cluster::publish::BucketObs;

    const MS: u64 = 1_000_000;

    /// A key born between two readings reads over the time since the readings before, as its
    /// peers read it through gossip (its counter since this host's sync before): over the time
    /// since its creation instead, a burst that made the bucket just before a round read many
    /// times what its peers read of it (2,385 packets/s here where they read 814), and the
    /// hosts' shares added up to 1.2-1.3 until the readings caught up.
    #[test]
    fn a_key_born_between_readings_reads_as_its_peers_read_it() {
        let name = KeyName {
            rule: "flood".into(),
            limit: 0,
            addr: "198.18.0.250".parse().unwrap(),
        };
        let (last, now) = (1_000 * MS, 1_100 * MS);
        let seen = HashMap::from([(
            name.clone(),
            BucketObs {
                created_ns: now - 10 * MS,
                passed_pkts: 40,
                passed_bytes: 0,
                dropped_pkts: 10,
            },
        )]);
        let mut known = HashMap::new();
        let demand = local_demand(&mut known, now, last, &seen, 3_000 * MS, 600 * MS);
        let read = demand[&name];
        assert!(
            (read - 500.0).abs() < 1e-6,
            "50 packets since the readings 100 ms before read {read}/s, not 500/s"
        );
    }

    /// The new pages and the walk share a quarter of a sync interval from the round's start:
    /// half each while a walk is under way, and at least a sixteenth each however late they
    /// start (the keys' own readings before them took the rest).
    #[test]
    fn the_pages_and_the_walk_share_a_quarter_interval() {
        let b = Budget::new(1_000 * MS, 100 * MS);
        assert_eq!(b.pages_until(1_000 * MS, false), 1_025 * MS);
        assert_eq!(b.pages_until(1_000 * MS, true), 1_012_500_000);
        assert_eq!(b.walk_until(1_012_500_000), 1_025 * MS);
        // The keys' readings took 20 ms, the pages then 10.
        assert_eq!(b.pages_until(1_020 * MS, true), 1_026_250_000);
        assert_eq!(b.walk_until(1_030 * MS), 1_036_250_000);
    }
}
