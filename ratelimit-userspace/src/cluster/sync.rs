//! The sync round, every `sync_interval_ms`: read the local buckets of cluster-scoped limits (a
//! rule's own or a `[[rule.limit]]`, each on its own) and publish the heaviest keys' counters
//! (admitted and demand); read the peers' demand from chitchat; give each local bucket its
//! share of the budget, in proportion to its demand ([`charge`]); refresh the status.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use chitchat::ChitchatId;
use ratelimit_common::{action, rule_flags, Limit, Rule};

use super::{
    charge,
    gossip::Gossip,
    partition::Partition,
    publish::{
        candidate_rate, sync_value, BucketObs, Count, Heaviest, KeyName, LocalTracker, KEY_PREFIX,
        SYNC_KEY,
    },
    remote::{ClusterLimits, DemandWindow, Limits, PeerView, RemoteTracker, Round},
    status::{Counters, HeaviestKeys, KeyRound, PeerStatus, Shared},
};
use tokio::sync::watch;

use crate::{
    compile::CompiledRuleSet,
    maps::{
        bucket::{bucket_addr, limit_bucket_key, monotonic_coarse_ns, monotonic_ns},
        PinnedMaps,
    },
};

/// Most peer incarnations read per round; more are ignored (and their keys counted as dropped).
pub const MAX_PEERS: usize = 64;

/// The limit rules in force here with at least one cluster-scoped limit (their own, or a
/// `[[rule.limit]]`), by name; only the buckets of their cluster-scoped limits are published
/// and charged.
#[derive(Clone, Debug, Default)]
pub struct ClusterRules {
    by_name: HashMap<String, (u32, Rule)>,
    by_id: HashMap<u32, String>,
}

impl ClusterRules {
    /// The rules of `set` with a cluster-scoped limit.
    #[must_use]
    pub fn of(set: &CompiledRuleSet) -> Self {
        let mut rules = Self::default();
        for r in &set.rules {
            if r.rule.action == action::LIMIT && cluster_limits(&r.rule).next().is_some() {
                rules.by_name.insert(r.name.clone(), (r.id, r.rule));
                rules.by_id.insert(r.id, r.name.clone());
            }
        }
        rules
    }

    /// Every cluster-scoped limit, by rule name and index.
    #[must_use]
    pub fn limits(&self) -> ClusterLimits {
        let mut out = ClusterLimits::default();
        for (name, (_, r)) in &self.by_name {
            for (k, l) in cluster_limits(r) {
                out.insert(name, k, Limits::of(&l));
            }
        }
        out
    }

    /// The rule (id and record) and limit `name` stands for, if that limit is cluster-scoped.
    fn limit_of(&self, name: &KeyName) -> Option<(u32, &Rule, Limit)> {
        let (id, rule) = self.by_name.get(&name.rule)?;
        let l = rule.limit(usize::from(name.limit))?;
        (l.flags & rule_flags::CLUSTER != 0).then_some((*id, rule, l))
    }

    /// The key of the bucket `b` under its rule's name, if that bucket belongs to a
    /// cluster-scoped limit.
    fn key_of(&self, b: &ratelimit_common::Bucket) -> Option<KeyName> {
        let (id, limit) = ratelimit_common::split_bucket_rule(u32::from(b.rule));
        let name = self.by_id.get(&id)?;
        let (_, rule) = self.by_name.get(name)?;
        let l = rule.limit(limit)?;
        (l.flags & rule_flags::CLUSTER != 0).then(|| KeyName {
            rule: name.clone(),
            limit: u8::try_from(limit).unwrap_or(u8::MAX),
            addr: bucket_addr(&b.key()),
        })
    }
}

/// The cluster-scoped limits of `rule`, with their indices.
fn cluster_limits(rule: &Rule) -> impl Iterator<Item = (u8, Limit)> + '_ {
    (0..rule.limits()).filter_map(|k| {
        let l = rule.limit(k)?;
        (l.flags & rule_flags::CLUSTER != 0).then(|| (u8::try_from(k).unwrap_or(u8::MAX), l))
    })
}

/// Everything the sync loop owns.
pub struct SyncLoop {
    /// The agent's rules in force.
    pub rules: watch::Receiver<Arc<CompiledRuleSet>>,
    /// chitchat's server, supervised (dropping it stops gossip).
    pub chitchat: Gossip,
    /// Our own handles on the pinned maps (the agent's stay behind its lock).
    pub maps: PinnedMaps,
    /// Shared with the agent.
    pub shared: Arc<Shared>,
    /// Sync period.
    pub interval: Duration,
    /// Cap on published and read keys.
    pub max_keys: usize,
    /// Silence after which a peer stops being counted.
    pub peer_timeout: Duration,
    /// `[cluster] on_partition` and the memory of hosts last known alive.
    pub partition: Partition,
}

struct Blocking {
    maps: PinnedMaps,
    local: LocalTracker,
    next_full_ns: u64,
    /// Per key read lately, its bucket's life, demand counter and readings, for this host's
    /// demand.
    demand: HashMap<KeyName, LocalDemand>,
    /// When the buckets were last read.
    last_observed_ns: u64,
    /// When this agent started.
    start_ns: u64,
    /// Per key, when its last round ran (whatever its share then).
    withheld_at: HashMap<KeyName, u64>,
}

/// Demand per key, packets per second.
type Demand = HashMap<KeyName, f64>;

/// This host's demand as it published it at its last few syncs (Unix ms of each sync, demand per
/// key), for dividing by figures as old as the peers' (see `SyncLoop::run`).
#[derive(Debug, Default)]
struct OwnFigures(std::collections::VecDeque<(u64, Demand)>);

impl OwnFigures {
    /// Syncs kept (this round's too): the gossip brings a figure within one or two sync
    /// intervals.
    const KEPT: usize = 5;

    fn push(&mut self, unix_ms: u64, demand: Demand) {
        self.0.push_back((unix_ms, demand));
        while self.0.len() > Self::KEPT {
            self.0.pop_front();
        }
    }

    /// Its figures as of `as_of` (the oldest counted peer's sync, Unix ms): the ones read
    /// nearest that time, before or after it (this round's, at the latest). Every host then
    /// divides figures that end at about the same time, so the shares add up to about 1 (with
    /// its last publication against peers that synced since, a host whose round falls late in
    /// the interval mixed its own old figure with their new ones: it took most of the budget
    /// for a round at every change of demand). Without counted peers, the last published (the
    /// one before this round's).
    fn as_of(&self, as_of: Option<u64>) -> Demand {
        let n = self.0.len();
        let Some(t) = as_of else {
            return n
                .checked_sub(2)
                .map(|i| self.0[i].1.clone())
                .unwrap_or_default();
        };
        let after = self.0.iter().position(|(at, _)| *at > t).unwrap_or(n - 1);
        let before = after.saturating_sub(1);
        let nearest = if t.abs_diff(self.0[before].0) <= t.abs_diff(self.0[after].0) {
            before
        } else {
            after
        };
        self.0[nearest].1.clone()
    }
}

/// One key's demand here: its bucket's life (`created_ns`), the raw 32-bit counter last read,
/// the count since it was first read, and the readings' window.
#[derive(Debug, Default)]
struct LocalDemand {
    created_ns: u64,
    raw: u64,
    count: u64,
    window: DemandWindow,
}

/// Folds the buckets read at `now_ns` into `known` and returns this host's demand per key
/// (packets that reached the bucket, admitted or dropped, per second) over its last
/// [`DEMAND_ROUNDS`](super::remote::DEMAND_ROUNDS) readings. Only keys read at least twice in
/// the same life of their bucket, or whose bucket was created since `last_ns` (the readings
/// before: its counters start at its creation), have one: for the others this host cannot
/// tell, and their bucket keeps its whole refill (fail open). Keys not read for `forget_ns` are
/// forgotten.
fn local_demand(
    known: &mut HashMap<KeyName, LocalDemand>,
    now_ns: u64,
    last_ns: u64,
    seen: &HashMap<KeyName, BucketObs>,
    forget_ns: u64,
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
                // Born since the last readings: all it counted is demand since its creation.
                d.raw = 0;
                d.window.push(b.created_ns, 0);
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
            let r = known.get(k)?.window.rate(1e9);
            Some((k.clone(), r)).filter(|_| known[k].window.len() >= 2)
        })
        .collect()
}

impl SyncLoop {
    /// Runs until the task is aborted.
    pub async fn run(self) {
        let Self {
            rules: in_force,
            mut chitchat,
            maps,
            shared,
            interval,
            max_keys,
            peer_timeout,
            mut partition,
        } = self;
        let start_ns = monotonic_ns();
        // No share of an earlier agent's holds for this one (see `Blocking::withhold`).
        let mut maps = maps;
        if let Err(e) = maps.update_config(|c| c.shares_until_ns = 0) {
            tracing::warn!(error = %e, "cluster sync: clearing the shares in force");
        }
        let cleared = maps.store().clear_shares(monotonic_ns());
        if cleared > 0 {
            tracing::info!(
                buckets = cleared,
                "cluster sync: cleared the shares an earlier agent left"
            );
        }
        let mut blocking = Some(Blocking {
            maps,
            local: LocalTracker::new(max_keys, start_ns),
            next_full_ns: 0,
            demand: HashMap::new(),
            last_observed_ns: start_ns,
            start_ns,
            withheld_at: HashMap::new(),
        });
        let timeout_ns = u64::try_from(peer_timeout.as_nanos()).unwrap_or(u64::MAX);
        let interval_ns = u64::try_from(interval.as_nanos()).unwrap_or(u64::MAX);
        let lag_ns = super::remote::lag_allowance_ns(interval_ns);
        let mut remote: RemoteTracker<ChitchatId> = RemoteTracker::new(timeout_ns, lag_ns);
        let mut last_round_ns: Option<u64> = None;
        // This host's demand as of the last round: the figure its peers divide by now.
        let mut own_figures = OwnFigures::default();
        let mut seq = 0u64;
        let mut was_counted: HashSet<ChitchatId> = HashSet::new();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let began = Instant::now();
            let rules = ClusterRules::of(&in_force.borrow());

            // 1. Local buckets -> published counters (map syscalls off the async threads).
            let Some(mut b) = blocking.take() else { return };
            let rules_for_scan = rules.clone();
            let joined = tokio::task::spawn_blocking(move || {
                let (set, deleted, demand) = b.observe(&rules_for_scan, interval_ns);
                (b, set, deleted, demand)
            })
            .await;
            let Ok((b, set, deleted, fresh_demand)) = joined else {
                tracing::error!("cluster sync: the bucket scan panicked; cluster sync stopped");
                return;
            };
            let next_epoch = b.local.next_epoch();
            let published = b.local.len();
            blocking = Some(b);
            seq += 1;
            let unix_ms = super::unix_ms();

            // 2. Publish, and read the peers (counting only identities that sealed an authentic
            // datagram from their advertised address within ten peer timeouts).
            let since = monotonic_ns().saturating_sub(timeout_ns.saturating_mul(10));
            let trusted = shared
                .authenticated
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .all_since(since);
            // Identities heard directly within the peer timeout: heard whatever their heartbeat
            // in chitchat (see [`PeerView::direct`]).
            let direct = shared
                .authenticated
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .last_since(monotonic_ns().saturating_sub(timeout_ns));
            // A loop that ended is restarted here (as a new incarnation, see [`Gossip`]).
            chitchat.supervise().await;
            let self_id = chitchat.handle().chitchat_id().clone();
            let own_max_version = &shared.own_max_version;
            let (views, dropped) = chitchat
                .handle()
                .with_chitchat(|c| {
                    let node = c.self_node_state();
                    for (k, v) in &set {
                        node.set(k, v);
                    }
                    for k in &deleted {
                        node.delete(k);
                    }
                    // Last: a peer holding this sync key holds every key set before it. It
                    // names the keys published now (`keys_digest`): a peer holding keys of
                    // this host that do not make it holds one relayed under this host's id.
                    let value = sync_value(
                        seq,
                        unix_ms,
                        next_epoch,
                        node.iter_prefix(KEY_PREFIX).map(|(k, _)| k),
                    );
                    node.set(SYNC_KEY, value);
                    // No peer can hold more of this host's state than this (a delta about it
                    // beyond is forged, see `inspect::check_own`).
                    own_max_version.store(node.max_version(), std::sync::atomic::Ordering::Relaxed);
                    let trimmed = trim_peer_states(c, &self_id, max_keys);
                    let now = monotonic_ns();
                    let (views, dropped, stored) = read_peers(
                        c,
                        &self_id,
                        max_keys,
                        |id| {
                            trusted.contains(&(
                                id.gossip_advertise_addr,
                                super::wire::sender_tag(&id.node_id, id.generation_id),
                            ))
                        },
                        |id| {
                            direct
                                .get(&(
                                    id.gossip_advertise_addr,
                                    super::wire::sender_tag(&id.node_id, id.generation_id),
                                ))
                                .copied()
                        },
                        |id, heartbeat| remote.heard(id, heartbeat, now),
                    );
                    ((views, stored), dropped + trimmed)
                })
                .await;
            let (views, stored) = views;
            let c = &shared.counters;
            Counters::add(&c.keys_dropped, dropped);
            c.keys_published
                .store(published as u64, std::sync::atomic::Ordering::Relaxed);

            // 3. Demand -> shares: each local bucket refills at its share of the rate.
            let now = monotonic_ns();
            remote.set_clock(super::unix_ms());
            let round = remote.round(now, &views, &rules.limits());
            Counters::add(&c.readings_refused, round.refused);
            if round.refused > 0 {
                tracing::debug!(
                    refused = round.refused,
                    "cluster sync: peers' readings refused (dated ahead, or going back)"
                );
            }
            let keys_synced = round.keys_synced;
            // `on_partition`: the hosts heard (distinct IP addresses) and the hosts last known alive.
            let counted_addrs: Vec<SocketAddr> = remote
                .info(now)
                .filter(|(_, i)| i.counted)
                .map(|(id, _)| id.gossip_advertise_addr)
                .collect();
            let share = partition.observe(now, &counted_addrs);
            let factor = partition.budget_share(share);
            let elapsed = last_round_ns.map_or(0, |t| now.saturating_sub(t));
            last_round_ns = Some(now);
            // Every host divides by the same figures: its own demand as its peers read it, no
            // newer than the figures it reads of them (the oldest counted peer's sync), not its
            // fresher reading. Shares computed from one vector add up to 1 whatever noise the
            // figures carry; with a fresher figure for itself than for the others, each host's
            // error is its own and they add up (1.25 x the budget at 8 hosts, even split, with
            // its own freshest reading). Rounds of different hosts fall at different times: with
            // its own last publication against peers' figures of a round before, a source
            // starting to send at every host found each host taking most of the budget for a
            // round, every on/off cycle (an on/off source admitted 1.4% over the rate a cycle).
            let oldest_peer = remote
                .info(now)
                .filter(|(_, i)| i.counted)
                .filter_map(|(_, i)| i.published_unix_ms)
                .min();
            own_figures.push(unix_ms, fresh_demand.clone());
            let mut local_demand = own_figures.as_of(oldest_peer);
            // A key with no figure published yet (new here) takes its fresh one: its peers have
            // no figure for it from this host either.
            for (k, d) in fresh_demand {
                local_demand.entry(k).or_insert(d);
            }
            let mut heaviest = HeaviestKeys::default();
            if elapsed > 0 && !local_demand.is_empty() {
                let Some(mut b) = blocking.take() else { return };
                let withheld = tokio::task::spawn_blocking(move || {
                    let w = b.withhold(&rules, &round, &local_demand, factor, elapsed, lag_ns);
                    (b, w)
                })
                .await;
                let Ok((b, w)) = withheld else {
                    tracing::error!(
                        "cluster sync: slowing the buckets panicked; cluster sync stopped"
                    );
                    return;
                };
                blocking = Some(b);
                for (id, pkts, bytes) in &w.per_peer {
                    remote.credit(id, *pkts, *bytes);
                }
                Counters::add(&c.charged_pkts, w.pkts);
                Counters::add(&c.charged_bytes, w.bytes);
                Counters::add(&c.charge_errors, w.errors);
                Counters::add(&c.charges_clamped, w.late);
                Counters::add(&c.share_charged_pkts, w.share_pkts);
                heaviest = w.keys;
            }
            c.keys_synced
                .store(keys_synced, std::sync::atomic::Ordering::Relaxed);

            // 4. Status.
            let peers = peer_statuses(&remote, now, super::unix_ms(), &stored);
            log_membership(&peers, &mut was_counted);
            let lag = peers
                .iter()
                .filter(|p| p.counted)
                .filter_map(|p| p.lag_ms)
                .max()
                .unwrap_or(0);
            c.sync_lag_ms.store(
                u64::try_from(lag).unwrap_or(0),
                std::sync::atomic::Ordering::Relaxed,
            );
            Counters::add(&c.syncs, 1);
            c.last_sync_us.store(
                u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX),
                std::sync::atomic::Ordering::Relaxed,
            );
            let mut view = shared.view();
            view.peers = peers;
            view.keys = heaviest.into_status(&self_id.node_id, self_id.generation_id);
            view.hosts_heard = share.heard;
            view.hosts_known = share.known;
            view.budget_share = partition.budget_share(share);
        }
    }
}

impl Blocking {
    /// Reads the buckets (all of them when a full scan is due, else the published keys') and
    /// returns the keys to set and delete.
    fn observe(
        &mut self,
        rules: &ClusterRules,
        interval_ns: u64,
    ) -> (Vec<(String, String)>, Vec<String>, Demand) {
        let now = monotonic_ns();
        let full = now >= self.next_full_ns;
        let mut seen: HashMap<KeyName, BucketObs> = HashMap::new();
        let obs = |b: &ratelimit_common::Bucket| BucketObs {
            created_ns: b.created_ns(),
            passed_pkts: u64::from(b.passed_pkts),
            passed_bytes: b.passed_bytes,
            dropped_pkts: u64::from(b.dropped_pkts),
        };
        if full {
            // Streamed: only the published keys' buckets and the `max_keys` heaviest others
            // are kept (all `select` can take), whatever the size of the store.
            let mut heaviest = Heaviest::new(self.local.max_keys());
            let scan = self.maps.for_each_bucket(|_, b| {
                let Some(key) = rules.key_of(b) else {
                    return;
                };
                if self.local.is_published(&key) {
                    seen.insert(key, obs(b));
                } else if b.passed_pkts > 0 || b.dropped_pkts > 0 {
                    heaviest.offer(candidate_rate(now, &obs(b)), key, obs(b));
                }
            });
            if let Err(e) = scan {
                tracing::warn!(error = %e, "cluster sync: reading the buckets");
            }
            seen.extend(heaviest.into_candidates());
            // A full scan reads the whole store (64 MiB for a million buckets), so it runs at
            // most a tenth of the time; in between only the published keys are read (one
            // lookup each).
            let took = monotonic_ns().saturating_sub(now);
            self.next_full_ns = now.saturating_add(interval_ns.max(took.saturating_mul(10)));
        } else {
            for name in self.local.keys() {
                let Some((id, rule, _)) = rules.limit_of(name) else {
                    continue;
                };
                let key = limit_bucket_key(id, rule, usize::from(name.limit), name.addr);
                if let Ok(Some(b)) = self.maps.bucket(&key) {
                    seen.insert(name.clone(), obs(&b));
                }
            }
        }
        self.local.update(now, &seen, full);
        // A full scan reads every key worth tracking (bounded by `max_keys` twice over); in
        // between, keys not read keep their readings for a while.
        let demand = local_demand(
            &mut self.demand,
            now,
            self.last_observed_ns,
            &seen,
            interval_ns.saturating_mul(30),
        );
        self.last_observed_ns = now;
        let (set, deleted) = self.local.changes();
        (set, deleted, demand)
    }

    /// Gives every key this host has a demand figure for its share of the budget (see
    /// [`charge`]): its bucket's share word, which the program scales the bucket's costs by, so
    /// that it refills at `share x rate` from now on, whenever this round runs; then moves
    /// `Config::shares_until_ns` on to `now + lag_ns` (shares hold until then: a stalled or
    /// stopped agent's lapse, and every bucket refills at its whole rate). `factor` is `heard /
    /// known` under `on_partition = "share"`, else 1. A key no longer tracked gets its share word
    /// cleared (the whole rate). Nothing takes back the refill a new key's bucket got at the whole
    /// rate before its first round (a first version did, `(1 - share) x` the time since the
    /// bucket was created: its debt, repaid at the share's rate, dropped 117 of 300 packets of
    /// a source under the budget at two hosts; the documented bound already allows each host its
    /// burst and a sync lag of the rate).
    fn withhold(
        &mut self,
        rules: &ClusterRules,
        round: &Round<ChitchatId>,
        local: &Demand,
        factor: f64,
        elapsed: u64,
        lag_ns: u64,
    ) -> Withheld {
        let mut w = Withheld::default();
        let now = monotonic_ns();
        let coarse = monotonic_coarse_ns();
        if elapsed > lag_ns {
            w.late = 1;
        }
        let gone: Vec<KeyName> = self
            .withheld_at
            .keys()
            .filter(|k| !local.contains_key(*k))
            .cloned()
            .collect();
        for name in gone {
            self.withheld_at.remove(&name);
            if let Some((id, rule, limit)) = rules.limit_of(&name) {
                let key = limit_bucket_key(id, rule, usize::from(name.limit), name.addr);
                if charge::set_share(&self.maps, &key, (0, 0), &limit, now, coarse).is_err() {
                    w.errors += 1;
                }
            }
        }
        for (name, &d) in local {
            let Some((id, rule, limit)) = rules.limit_of(name) else {
                continue;
            };
            let last = self.withheld_at.insert(name.clone(), now);
            // The time since this key's last round; for a key in its first, since its bucket
            // was created (if this agent saw that).
            let since = last.or_else(|| {
                self.demand
                    .get(name)
                    .map(|d| d.created_ns)
                    .filter(|&c| c >= self.start_ns)
            });
            let elapsed = since.map_or(elapsed, |t| now.saturating_sub(t));
            let peers = round.peer_demand(name);
            // The hosts holding the key (this one and the counted peers publishing it): an idle
            // key keeps an even part at each, not the whole rate at every one.
            let hosts = f64::from(round.hosts_holding(name));
            let rate = charge::packet_rate(&limit);
            let s = charge::share(d, peers, factor, rate, hosts);
            let key = limit_bucket_key(id, rule, usize::from(name.limit), name.addr);
            // The refill the share withholds over the time since the last round (counted;
            // nothing moves the bucket's arrival times: the share word does it all).
            let advance = charge::advance_ns(s, elapsed, lag_ns);
            let word = charge::share_word(s);
            let holders = round.hosts_holding(name);
            match charge::set_share(&self.maps, &key, (word, holders), &limit, now, coarse) {
                Ok(Some(_)) => {}
                Ok(None) => continue,
                Err(e) => {
                    w.errors += 1;
                    tracing::debug!(error = %e, rule = %name.rule, limit = name.limit, addr = %name.addr, "cluster sync: setting a bucket's share");
                    continue;
                }
            }
            // For `peers` and the metrics: each holder's demand and share, if among the heaviest.
            w.keys.offer(&KeyRound {
                name,
                limit: &limit,
                demand: d,
                share: s,
                hosts: round.hosts_holding(name),
                peers: round.demand.get(name).map_or(&[], Vec::as_slice),
                factor,
                rate,
            });
            // The part of it for hosts missing (`share`): what the factor took.
            let without =
                charge::advance_ns(charge::share(d, peers, 1.0, rate, hosts), elapsed, lag_ns);
            // Counted as withheld for the peers only while some have demand (then each has its
            // part of the rest, below); an even part of an idle key, or of a key only this host
            // has demand for, takes nothing for any peer's demand: only what the factor took.
            let counted = if peers > 0.0 {
                advance
            } else {
                advance.saturating_sub(without)
            };
            let (pkts, bytes) = charge::withheld(&limit, counted, counted);
            w.pkts += pkts;
            w.bytes += bytes;
            if advance > without {
                w.share_pkts += charge::withheld(&limit, advance - without, 0).0;
            }
            // Each counted peer's part of the rest, by its demand.
            if peers > 0.0 {
                if let Some(list) = round.demand.get(name) {
                    let (pp, pb) = charge::withheld(&limit, without, without);
                    for (peer, r) in list {
                        #[expect(
                            clippy::cast_possible_truncation,
                            clippy::cast_sign_loss,
                            clippy::cast_precision_loss,
                            reason = "a part of a count"
                        )]
                        let part = |n: u64| (n as f64 * r / peers).round() as u64;
                        w.per_peer.push((peer.clone(), part(pp), part(pb)));
                    }
                }
            }
        }
        // The shares hold until the end of this round's lag allowance.
        let until = monotonic_ns().saturating_add(lag_ns);
        if let Err(e) = self.maps.update_config(|c| c.shares_until_ns = until) {
            w.errors += 1;
            tracing::warn!(error = %e, "cluster sync: the shares could not be renewed (buckets refill at the whole rate)");
        }
        w
    }
}

/// What one round withheld.
#[derive(Debug, Default)]
struct Withheld {
    /// Packets and bytes of refill withheld for the peers' demand and for hosts missing (TAT
    /// advance in packets and bytes; not the even part an idle key's share holds back, which
    /// no peer's demand takes).
    pkts: u64,
    bytes: u64,
    /// Of the packets, what `on_partition = "share"` withheld for hosts missing.
    share_pkts: u64,
    /// Per counted peer, its part (by demand) of the rest.
    per_peer: Vec<(ChitchatId, u64, u64)>,
    /// Buckets that could not be slowed.
    errors: u64,
    /// 1 when the round ran later than the lag allowance (its advance cut to it).
    late: u64,
    /// The heaviest keys whose share was set, with each holder's demand and share.
    keys: HeaviestKeys,
}

/// Where a member stands in one sync.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Live, its address sent an authentic datagram lately, and it is the newest incarnation
    /// with a sync key at that address: may be counted (the first [`MAX_PEERS`] of them).
    Candidate,
    /// Live in gossip, but no authentic datagram sealed by this identity came from its address
    /// lately (an id only named in others' digests or deltas, at any address, even a real
    /// member's): never counted.
    Unverified,
    /// Live and authenticated, but no sync key yet (joining, or an id only named in a digest at
    /// a real peer's address): shown, takes no place under [`MAX_PEERS`], charges nothing.
    Pending,
    /// Live, authenticated, the newest with a sync key at its address, but its heartbeat has
    /// not advanced for the peer timeout (stopped, or cut off while chitchat's failure detector
    /// still deems it alive): shown `silent`, takes no place under [`MAX_PEERS`], charges
    /// nothing.
    Silent,
    /// A newer incarnation at the same address took over: shown dead, never counted.
    Superseded,
    /// Dead according to the failure detector.
    Dead,
}

/// A member as `standings` sees it.
#[derive(Clone, Copy, Debug)]
pub struct Member<'a> {
    /// Its identity.
    pub id: &'a ChitchatId,
    /// Alive according to the failure detector.
    pub live: bool,
    /// It published a sync key.
    pub has_sync: bool,
    /// An authentic datagram sealed by this identity came from its advertised address lately.
    pub authenticated: bool,
    /// Its heartbeat advanced within the peer timeout (see [`RemoteTracker::heard`]).
    pub heard: bool,
}

/// The standing of every member: only live, authenticated, heard members that are the newest
/// incarnation with a sync key at their address are candidates, so ids merely named in gossip
/// create no charging peer and neither they, silent members nor dead incarnations take a place
/// under [`MAX_PEERS`].
#[must_use]
pub fn standings(members: &[Member<'_>]) -> Vec<Standing> {
    let mut newest: HashMap<SocketAddr, u64> = HashMap::new();
    for m in members {
        if m.live && m.authenticated && m.has_sync {
            let g = newest.entry(m.id.gossip_advertise_addr).or_insert(0);
            *g = (*g).max(m.id.generation_id);
        }
    }
    members
        .iter()
        .map(|m| {
            if !m.live {
                Standing::Dead
            } else if !m.authenticated {
                Standing::Unverified
            } else if newest
                .get(&m.id.gossip_advertise_addr)
                .is_some_and(|g| *g > m.id.generation_id)
            {
                Standing::Superseded
            } else if !m.has_sync {
                Standing::Pending
            } else if !m.heard {
                Standing::Silent
            } else {
                Standing::Candidate
            }
        })
        .collect()
}

/// Keeps at most `max_keys` consumption keys and the sync key in every other member's node
/// state, so a peer publishing more keys than `max_keys` holds no more of this agent's memory
/// than that after each round (whatever arrives within one round, at most). Kept: the sync
/// key, then the consumption keys [`read_peers`] reads (the first in key order), then
/// tombstones; anything else goes. Returns the number of keys removed.
///
/// chitchat offers no hook where it applies deltas, so the state is rewritten through
/// `reset_node_state_if_update`, which requires `(last_gc_version, max_version)` to grow: the
/// last GC version is raised to the max version (as if the removed keys had been deleted and
/// collected), so the peer's later updates (newer versions) still apply here, and members
/// behind us on that peer get a full reset of the trimmed state from us rather than a delta
/// missing deletions. Only when that pair cannot grow (a state received in a reset whose GC
/// version already equals its max version: only a peer that published too many keys sends
/// that) is the max version raised by one, which skips at most that peer's next version.
pub(crate) fn trim_peer_states(
    c: &mut chitchat::Chitchat,
    self_id: &ChitchatId,
    max_keys: usize,
) -> u64 {
    let mut rewrites = Vec::new();
    for (id, state) in c.node_states() {
        if id == self_id || state.key_values_including_deleted().count() <= max_keys + 1 {
            continue;
        }
        let mut kept: Vec<(String, chitchat::VersionedValue)> = Vec::with_capacity(max_keys + 1);
        if let Some(v) = state.get_versioned(SYNC_KEY) {
            kept.push((SYNC_KEY.to_string(), v.clone()));
        }
        let counters = || {
            state
                .key_values_including_deleted()
                .filter(|(k, _)| k.starts_with(KEY_PREFIX))
        };
        kept.extend(
            counters()
                .filter(|(_, v)| !v.is_deleted())
                .chain(counters().filter(|(_, v)| v.is_deleted()))
                .take(max_keys)
                .map(|(k, v)| (k.to_string(), v.clone())),
        );
        let removed = state.key_values_including_deleted().count() - kept.len();
        let (gc, max) = (state.last_gc_version(), state.max_version());
        let to = if gc < max { max } else { max + 1 };
        rewrites.push((id.clone(), kept, to, removed));
    }
    let mut removed_total = 0u64;
    for (id, kept, to, removed) in rewrites {
        c.reset_node_state_if_update(&id, kept.into_iter(), to, to);
        removed_total += removed as u64;
    }
    if removed_total > 0 {
        tracing::debug!(
            removed = removed_total,
            max_keys,
            "cluster sync: peers' keys beyond max_keys removed from the gossip state"
        );
    }
    removed_total
}

/// The other members' views, the number of keys left out, and the number of keys stored for
/// each member (tombstones included): the first [`MAX_PEERS`] candidates (see [`standings`])
/// with at most `max_keys` keys each, then at most as many other members, without keys, to
/// show. `authenticated` says whether an authentic datagram sealed by a member's identity came
/// from its advertised address lately (ten peer timeouts); `direct`, when the last one did, if
/// within the peer timeout (alive and heard, whatever chitchat's failure detector and heartbeat
/// say);
/// `heard`, whether a member with this heartbeat is still heard.
fn read_peers(
    c: &chitchat::Chitchat,
    self_id: &ChitchatId,
    max_keys: usize,
    authenticated: impl Fn(&ChitchatId) -> bool,
    direct: impl Fn(&ChitchatId) -> Option<u64>,
    heard: impl Fn(&ChitchatId, u64) -> bool,
) -> (Vec<PeerView<ChitchatId>>, u64, HashMap<ChitchatId, usize>) {
    let live: HashSet<&ChitchatId> = c.live_nodes().collect();
    let states: Vec<(&ChitchatId, &chitchat::NodeState)> = c
        .node_states()
        .iter()
        // Our own earlier incarnations (before a gossip restart) come back through peers'
        // gossip: they are not peers.
        .filter(|(id, _)| {
            id.node_id != self_id.node_id
                || id.gossip_advertise_addr != self_id.gossip_advertise_addr
        })
        .collect();
    let members: Vec<Member<'_>> = states
        .iter()
        .map(|(id, state)| Member {
            id,
            // Alive and heard if chitchat says so, or if it sealed an authentic datagram from its
            // address within the peer timeout (a heartbeat pushed ahead in chitchat by another
            // member makes chitchat's failure detector stop hearing it).
            live: live.contains(id) || direct(id).is_some(),
            has_sync: state.get(SYNC_KEY).is_some(),
            authenticated: authenticated(id),
            heard: direct(id).is_some() || heard(id, u64::from(state.heartbeat())),
        })
        .collect();
    let standing = standings(&members);
    let mut views = Vec::new();
    let (mut candidates, mut others) = (0usize, 0usize);
    let mut dropped = 0u64;
    let stored = states
        .iter()
        .map(|(id, state)| ((*id).clone(), state.key_values_including_deleted().count()))
        .collect();
    for ((id, state), standing) in states.iter().zip(standing) {
        let counting = standing == Standing::Candidate && candidates < MAX_PEERS;
        let mut keys = Vec::new();
        if standing == Standing::Candidate {
            let mut extra = 0u64;
            for (k, v) in state.iter_prefix(KEY_PREFIX) {
                if !counting || keys.len() >= max_keys {
                    extra += 1;
                    continue;
                }
                if let (Some(name), Some(count)) = (KeyName::parse(k), Count::parse(&v.value)) {
                    keys.push((name, count));
                }
            }
            dropped += extra;
            if !counting {
                continue;
            }
            candidates += 1;
        } else {
            if others >= MAX_PEERS {
                continue;
            }
            others += 1;
        }
        // A silent member's sync key is not read: it cannot be counted this round.
        let sync_value = state.get(SYNC_KEY).filter(|_| standing != Standing::Silent);
        let sync = sync_value.and_then(super::remote::parse_sync);
        let keys_digest = sync_value.and_then(super::remote::parse_keys_digest);
        views.push(PeerView {
            id: (*id).clone(),
            live: matches!(
                standing,
                Standing::Candidate | Standing::Pending | Standing::Unverified | Standing::Silent
            ),
            verified: matches!(
                standing,
                Standing::Candidate | Standing::Pending | Standing::Silent
            ),
            heartbeat: u64::from(state.heartbeat()),
            heard_at: direct(id),
            sync,
            keys_digest,
            keys,
        });
    }
    (views, dropped, stored)
}

fn peer_statuses(
    remote: &RemoteTracker<ChitchatId>,
    now: u64,
    unix_ms: u64,
    stored: &HashMap<ChitchatId, usize>,
) -> Vec<PeerStatus> {
    let mut peers: BTreeMap<(String, u64, SocketAddr), PeerStatus> = BTreeMap::new();
    for (id, info) in remote.info(now) {
        let state = if !info.live {
            "dead"
        } else if !info.verified {
            "unverified"
        } else if !info.heard {
            "silent"
        } else if !info.counted {
            "joining"
        } else {
            "alive"
        };
        peers.insert(
            (
                id.node_id.to_string(),
                id.generation_id,
                id.gossip_advertise_addr,
            ),
            PeerStatus {
                node_id: id.node_id.to_string(),
                generation: id.generation_id,
                addr: id.gossip_advertise_addr,
                state,
                counted: info.counted,
                last_heard_ms: Some(info.silent_ns / 1_000_000),
                lag_ms: info.published_unix_ms.map(|p| {
                    i64::try_from(unix_ms).unwrap_or(i64::MAX)
                        - i64::try_from(p).unwrap_or(i64::MAX)
                }),
                keys: info.keys,
                stored_keys: stored.get(id).copied().unwrap_or(0),
                charged_pkts: info.charged_pkts,
                charged_bytes: info.charged_bytes,
                clamped: 0,
            },
        );
    }
    peers.into_values().collect()
}

/// Logs peers that started or stopped being counted.
fn log_membership(peers: &[PeerStatus], was: &mut HashSet<ChitchatId>) {
    let mut now_counted = HashSet::new();
    for p in peers {
        let id = ChitchatId::new(p.node_id.as_str(), p.generation, p.addr);
        if p.counted {
            if !was.contains(&id) {
                tracing::info!(peer = %p.node_id, generation = p.generation, addr = %p.addr, "cluster peer counted");
            }
            now_counted.insert(id);
        } else if was.contains(&id) {
            tracing::warn!(peer = %p.node_id, generation = p.generation, addr = %p.addr, state = p.state, "cluster peer no longer counted: enforcing without its consumption");
        }
    }
    for gone in was.difference(&now_counted) {
        if !peers
            .iter()
            .any(|p| p.node_id == *gone.node_id && p.generation == gone.generation_id)
        {
            tracing::warn!(peer = %gone.node_id, generation = gone.generation_id, "cluster peer left");
        }
    }
    *was = now_counted;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str, generation: u64, port: u16) -> ChitchatId {
        ChitchatId::new(name.to_string(), generation, ([192, 0, 2, 1], port).into())
    }

    /// 100 ids that only appear in gossip (their addresses never sent an authentic datagram),
    /// sorting before the real peer, dead incarnations of it, and a forged newer incarnation at
    /// its address that published no sync key: none is a candidate, none pushes the real peer
    /// out of [`MAX_PEERS`].
    #[test]
    fn only_authenticated_live_newest_incarnations_are_candidates() {
        let forged: Vec<ChitchatId> = (0..100)
            .map(|i| id(&format!("aaa{i:03}"), 1, 1000 + i))
            .collect();
        let dead: Vec<ChitchatId> = (0..100).map(|g| id("real", g, 7946)).collect();
        let real = id("real", 1000, 7946);
        let digest_only = id("real", 2000, 7946);
        let mut members: Vec<Member<'_>> = forged
            .iter()
            .map(|id| Member {
                id,
                live: true,
                has_sync: true,
                authenticated: false,
                heard: true,
            })
            .collect();
        members.extend(dead.iter().map(|id| Member {
            id,
            live: false,
            has_sync: true,
            authenticated: true,
            heard: true,
        }));
        members.push(Member {
            id: &real,
            live: true,
            has_sync: true,
            authenticated: true,
            heard: true,
        });
        members.push(Member {
            id: &digest_only,
            live: true,
            has_sync: false,
            authenticated: true,
            heard: true,
        });
        let s = standings(&members);
        assert!(s[..100].iter().all(|s| *s == Standing::Unverified));
        assert!(s[100..200].iter().all(|s| *s == Standing::Dead));
        assert_eq!(s[200], Standing::Candidate, "the real peer");
        // Named without a sync key: it cannot take over, nor take a place.
        assert_eq!(s[201], Standing::Pending);
        assert_eq!(
            s.iter().filter(|s| **s == Standing::Candidate).count(),
            1,
            "{s:?}"
        );
        // A restart: the new incarnation (with its sync key) supersedes the old one.
        let newer = id("real", 3000, 7946);
        members.push(Member {
            id: &newer,
            live: true,
            has_sync: true,
            authenticated: true,
            heard: true,
        });
        let s = standings(&members);
        assert_eq!(
            (s[200], s[202]),
            (Standing::Superseded, Standing::Candidate)
        );
        // The new incarnation stops: silent, no longer a candidate, and still the newest (the
        // old one does not come back).
        members[202].heard = false;
        let s = standings(&members);
        assert_eq!((s[200], s[202]), (Standing::Superseded, Standing::Silent));
        assert_eq!(s.iter().filter(|s| **s == Standing::Candidate).count(), 0);
    }

    /// Only the cluster-scoped limits of a rule are published and charged, each its own
    /// bucket: a rule whose own limit is local and whose aggregate `[[rule.limit]]` is cluster
    /// gives limit 1 alone; rules without a cluster-scoped limit, or not limiting, give nothing.
    #[test]
    fn cluster_rules_take_each_limit_by_its_own_scope() {
        let text = "[agent]\ninterfaces = [\"eth0\"]\n\
            [cluster]\nlisten = \"192.0.2.1:7946\"\nkey_file = \"/k\"\n\
            [[rule]]\nname = \"web\"\nsource = \"198.18.0.0/24\"\nrate = 200\n\
            [[rule.limit]]\nper = \"/28\"\nrate = 500\n\
            [[rule.limit]]\nper = \"rule\"\nrate = 1000\nburst = 500\nscope = \"cluster\"\n\
            [[rule]]\nname = \"own\"\nsource = \"10.0.0.0/8\"\nrate = 5\nscope = \"cluster\"\n\
            [[rule.limit]]\nper = \"rule\"\nrate = 50\n\
            [[rule]]\nname = \"local\"\nsource = \"10.1.0.0/16\"\nrate = 5\n\
            [[rule]]\nname = \"office\"\nsource = \"10.2.0.0/16\"\naction = \"allow\"\n";
        let config = crate::config::Config::parse(text, "test.toml").unwrap();
        let set = crate::compile::compile(&config.rules, &crate::compile::RuleIds::new()).unwrap();
        let rules = ClusterRules::of(&set);
        let mut names: Vec<&String> = rules.by_name.keys().collect();
        names.sort();
        assert_eq!(names, ["own", "web"]);
        let key = |rule: &str, limit: u8, addr: [u8; 4]| KeyName {
            rule: rule.into(),
            limit,
            addr: std::net::IpAddr::from(addr),
        };
        let limits = rules.limits();
        assert!(limits.get(&key("web", 0, [198, 18, 0, 7])).is_none());
        assert!(limits.get(&key("web", 1, [198, 18, 0, 0])).is_none());
        let agg = limits.get(&key("web", 2, [0, 0, 0, 0])).unwrap();
        assert_eq!(
            (agg.pkt_interval_ns, agg.pkt_tolerance_ns),
            (1_000_000, 500_000_000)
        );
        let own = limits.get(&key("own", 0, [10, 0, 0, 1])).unwrap();
        assert_eq!(own.pkt_interval_ns, 200_000_000);
        assert!(limits.get(&key("own", 1, [0, 0, 0, 0])).is_none());
        assert!(limits.get(&key("local", 0, [10, 1, 0, 1])).is_none());
        // The bucket the aggregate's key names is the one the XDP program keys limit 2 with.
        let (id, rule, l) = rules.limit_of(&key("web", 2, [0, 0, 0, 0])).unwrap();
        assert_eq!(l.pkt_interval_ns, 1_000_000);
        let b = ratelimit_common::Bucket {
            rule: u16::try_from(ratelimit_common::bucket_rule(id, 2)).unwrap(),
            family: ratelimit_common::family::V4,
            ..ratelimit_common::Bucket::default()
        };
        assert_eq!(rules.key_of(&b), Some(key("web", 2, [0, 0, 0, 0])));
        assert_eq!(
            limit_bucket_key(id, rule, 2, std::net::IpAddr::from([198, 18, 0, 9])),
            b.key()
        );
        // One key for both families (per = "rule"): an IPv6 source's is the same, so the
        // cluster publishes and shares one budget for the limit.
        assert_eq!(
            limit_bucket_key(id, rule, 2, "2001:db8::9".parse().unwrap()),
            b.key()
        );
        // A bucket of the rule's local limits is not the cluster's.
        let local = ratelimit_common::Bucket {
            rule: u16::try_from(ratelimit_common::bucket_rule(id, 0)).unwrap(),
            ..b
        };
        assert_eq!(rules.key_of(&local), None);
    }

    fn chitchat(self_id: &ChitchatId) -> chitchat::Chitchat {
        let (_tx, seeds) = tokio::sync::watch::channel(HashSet::new());
        let config = chitchat::ChitchatConfig {
            chitchat_id: self_id.clone(),
            cluster_id: "test".to_string(),
            gossip_interval: Duration::from_millis(100),
            listen_addr: self_id.gossip_advertise_addr,
            seed_nodes: Vec::new(),
            failure_detector_config: chitchat::FailureDetectorConfig::default(),
            marked_for_deletion_grace_period: Duration::from_secs(60),
            catchup_callback: None,
            extra_liveness_predicate: None,
            protocol_version: chitchat::ProtocolVersion::V1,
        };
        chitchat::Chitchat::with_chitchat_id_and_seeds(config, seeds, Vec::new())
    }

    fn value(value: &str, version: u64, deleted: bool) -> chitchat::VersionedValue {
        chitchat::VersionedValue {
            value: value.to_string(),
            version,
            status: if deleted {
                chitchat::DeletionStatus::Deleted(tokio::time::Instant::now())
            } else {
                chitchat::DeletionStatus::Set
            },
        }
    }

    /// A peer publishing 10 x `max_keys` keys (and as many tombstones) keeps `max_keys` of them
    /// and its sync key here: the first in key order, which `read_peers` reads; the rest are
    /// gone from chitchat's state and counted. Its later keys (newer versions) still arrive,
    /// and are trimmed again; a peer within the cap is not touched.
    #[test]
    fn peers_keep_at_most_max_keys_stored() {
        let me = id("me", 1, 1);
        let flood = id("flood", 1, 2);
        let honest = id("honest", 1, 3);
        let max_keys = 10;
        let mut c = chitchat(&me);
        let mut kvs: Vec<(String, chitchat::VersionedValue)> = (0..10 * max_keys)
            .map(|i| {
                let k = format!("{KEY_PREFIX}r/10.0.{}.{}", i / 256, i % 256);
                (k, value("0:1:1", i as u64 + 1, false))
            })
            .collect();
        kvs.extend((0..10 * max_keys).map(|i| {
            let k = format!("{KEY_PREFIX}gone/{i}");
            (k, value("", (10 * max_keys + i) as u64 + 1, true))
        }));
        kvs.push((SYNC_KEY.to_string(), value("1:1:1", 201, false)));
        c.reset_node_state_if_update(&flood, kvs.into_iter(), 201, 0);
        let small: Vec<(String, chitchat::VersionedValue)> = vec![
            (format!("{KEY_PREFIX}r/10.9.0.1"), value("0:1:1", 1, false)),
            (SYNC_KEY.to_string(), value("1:1:1", 2, false)),
        ];
        c.reset_node_state_if_update(&honest, small.into_iter(), 2, 0);
        let stored = |c: &chitchat::Chitchat, id: &ChitchatId| {
            c.node_state(id)
                .unwrap()
                .key_values_including_deleted()
                .count()
        };
        assert_eq!(stored(&c, &flood), 20 * max_keys + 1);

        let removed = trim_peer_states(&mut c, &me, max_keys);
        assert_eq!(removed as usize, 19 * max_keys);
        assert_eq!(stored(&c, &flood), max_keys + 1);
        let state = c.node_state(&flood).unwrap();
        assert!(state.get(SYNC_KEY).is_some());
        let kept: Vec<&str> = state.iter_prefix(KEY_PREFIX).map(|(k, _)| k).collect();
        assert_eq!(kept.len(), max_keys);
        assert_eq!(kept[0], format!("{KEY_PREFIX}r/10.0.0.0"));
        assert_eq!((state.last_gc_version(), state.max_version()), (201, 201));
        assert_eq!(stored(&c, &honest), 2, "within the cap: untouched");
        assert_eq!(c.node_state(&honest).unwrap().max_version(), 2);
        assert_eq!(
            trim_peer_states(&mut c, &me, max_keys),
            0,
            "nothing left to trim"
        );

        // The peer publishes 10 x max_keys more: the state grows, and is trimmed again.
        let more: Vec<(String, chitchat::VersionedValue)> = c
            .node_state(&flood)
            .unwrap()
            .key_values_including_deleted()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .chain((0..10 * max_keys).map(|i| {
                (
                    format!("{KEY_PREFIX}s/10.1.0.{i}"),
                    value("0:1:1", 202 + i as u64, false),
                )
            }))
            .collect();
        let top = 201 + 10 * max_keys as u64;
        c.reset_node_state_if_update(&flood, more.into_iter(), top, 201);
        assert_eq!(stored(&c, &flood), 11 * max_keys + 1);
        assert_eq!(
            trim_peer_states(&mut c, &me, max_keys) as usize,
            10 * max_keys
        );
        assert_eq!(stored(&c, &flood), max_keys + 1);
        assert_eq!(c.node_state(&flood).unwrap().max_version(), top);

        // A state whose GC version already equals its max version (sent in a reset): the max
        // version moves on by one so the trim can apply.
        let reset: Vec<(String, chitchat::VersionedValue)> = (0..3 * max_keys)
            .map(|i| (format!("{KEY_PREFIX}t/{i}"), value("0:1:1", 1, false)))
            .collect();
        let evil = id("evil", 1, 4);
        c.reset_node_state_if_update(&evil, reset.into_iter(), 500, 500);
        assert_eq!(
            trim_peer_states(&mut c, &me, max_keys) as usize,
            2 * max_keys
        );
        assert_eq!(stored(&c, &evil), max_keys);
        assert_eq!(c.node_state(&evil).unwrap().max_version(), 501);
        // Our own state is never trimmed.
        for i in 0..3 * max_keys {
            c.self_node_state().set(format!("{KEY_PREFIX}x/{i}"), "v");
        }
        assert_eq!(trim_peer_states(&mut c, &me, max_keys), 0);
    }

    /// What gossip leaves in a host's chitchat state when a member with the key relays, under an
    /// honest member's id, an idle key of a source that member never published (a delta with
    /// the next version of that member: chitchat applies it, and keeps the key for as long as
    /// the member lives, since the member never re-sets or deletes a key it does not have). Its
    /// sync key names the digest of the keys it publishes, so the keys read here no longer make
    /// it: its idle keys are not held (fail open), and the relayed key never holds the source
    /// at a part of its rate here. Before, the source was held by two hosts here for ever
    /// (`1 / 2` of its rate and burst) once the relaying member had stopped.
    #[test]
    fn a_key_relayed_under_a_members_id_is_told_apart_by_its_sync_key() {
        let me = id("me", 1, 1);
        let a = id("a", 1, 2);
        let mut own = chitchat(&a);
        let mut here = chitchat(&me);
        let key = |addr: [u8; 4]| KeyName {
            rule: "flood".into(),
            limit: 0,
            addr: std::net::IpAddr::from(addr),
        };
        let (its, victim) = (key([198, 18, 0, 7]), key([198, 18, 0, 100]));
        // `a` publishes one idle key, then its sync key, as the sync loop does.
        let publish = |own: &mut chitchat::Chitchat, seq: u64| {
            let node = own.self_node_state();
            node.set(its.to_key(), "1:0:0:0");
            let v = sync_value(
                seq,
                seq * 100,
                2,
                node.iter_prefix(KEY_PREFIX).map(|(k, _)| k),
            );
            node.set(SYNC_KEY, v);
        };
        // Gossip brings `a`'s state here (plus `extra`, relayed under its id).
        let deliver = |own: &mut chitchat::Chitchat,
                       here: &mut chitchat::Chitchat,
                       extra: Option<(String, u64)>| {
            let node = own.self_node_state();
            let mut kvs: Vec<(String, chitchat::VersionedValue)> = here
                .node_state(&a)
                .map(|s| {
                    s.key_values_including_deleted()
                        .map(|(k, v)| (k.to_string(), v.clone()))
                        .collect()
                })
                .unwrap_or_default();
            let mut max = here
                .node_state(&a)
                .map_or(0, chitchat::NodeState::max_version);
            for (k, v) in node.key_values_including_deleted() {
                if v.version > max {
                    kvs.retain(|(x, _)| x != k);
                    kvs.push((k.to_string(), v.clone()));
                }
            }
            max = max.max(node.max_version());
            if let Some((k, version)) = extra {
                kvs.push((k, value("1:0:0:0", version, false)));
                max = max.max(version);
            }
            here.reset_node_state_if_update(&a, kvs.into_iter(), max, 0);
        };
        let limits = ClusterLimits::default().with(
            "flood",
            0,
            Limits {
                pkt_interval_ns: 1_000_000,
                pkt_tolerance_ns: 500_000_000,
                byte_interval_fp: 0,
                byte_tolerance_ns: 0,
            },
        );
        let mut tracker: RemoteTracker<ChitchatId> = RemoteTracker::new(3_000_000_000, 300_000_000);
        let mut round = |here: &chitchat::Chitchat, seq: u64| {
            let (views, _, _) = read_peers(
                here,
                &me,
                1000,
                |_| true,
                |_| Some(seq * 100_000_000),
                |_, _| true,
            );
            tracker.round(seq * 100_000_000, &views, &limits)
        };
        for seq in 1..=3 {
            publish(&mut own, seq);
            deliver(&mut own, &mut here, None);
            round(&here, seq);
        }
        let r = round(&here, 4);
        assert_eq!(
            (r.hosts_holding(&its), r.hosts_holding(&victim)),
            (2, 1),
            "its own idle key is held by it: {r:?}"
        );
        // The relay: the victim's key at `a`'s next version.
        let next = here.node_state(&a).unwrap().max_version() + 1;
        deliver(&mut own, &mut here, Some((victim.to_key(), next)));
        // `a` carries on; the attacker is gone. Its sync key keeps moving here.
        let mut held = Vec::new();
        for seq in 5..=100 {
            publish(&mut own, seq);
            deliver(&mut own, &mut here, None);
            let r = round(&here, seq);
            held.push((r.hosts_holding(&its), r.hosts_holding(&victim)));
        }
        assert!(
            here.node_state(&a).unwrap().get(&victim.to_key()).is_some(),
            "chitchat keeps the relayed key"
        );
        assert_eq!(
            here.node_state(&a)
                .unwrap()
                .get(SYNC_KEY)
                .and_then(super::super::remote::parse_sync)
                .map(|s| s.0),
            Some(100),
            "its sync key moved on"
        );
        assert!(
            held[1..].iter().all(|&h| h == (1, 1)),
            "the relayed key is never held, nor (fail open) its idle keys: {held:?}"
        );
    }
}
