//! The sync round of `backend = "redis"`: the same round as gossip's (read the local buckets,
//! each key's demand, set each bucket's share from its demand over the cluster's), with the
//! peers' demand exchanged through the Redis store ([`RedisStore`]) instead of gossip. Every
//! round writes this host's demand for each key it holds and reads the other holders' in the
//! same call; the shares are then computed exactly as with gossip ([`shares::share`] through
//! `StoreSide::set_shares`), so the arithmetic, the simulator and docs/cluster.md's bound are
//! the same.
//!
//! When the store cannot be reached, the figures read before are kept and go stale as a silent
//! gossip peer's do ([`Timing::stale_ns`]): then every key is held by this host alone and its
//! bucket refills at the whole rate (fail open), shown in the status (`store.state = "down"`,
//! the error) and logged once per change.
//!
//! [`shares::share`]: crate::cluster::shares::share
//! [`Timing::stale_ns`]: crate::cluster::timing::Timing::stale_ns

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::Instant,
};

use chitchat::ChitchatId;
use tokio::sync::watch;

use super::{
    demand::{observe_off_thread, Demand},
    peer_status::{count_late, count_sync},
    set_shares::{clear_earlier_shares, count_withheld, set_shares_off_thread},
    ClusterRules, StoreSide,
};
use crate::{
    cluster::{
        publish::KeyName,
        redis::{key_name, Entry, Field, RedisStore},
        remote::{RemoteTracker, Round},
        shares::OwnFigures,
        status::{Counters, HeaviestKeys, PeerStatus, Shared, StoreStatus},
        timing::Timing,
    },
    compile::CompiledRuleSet,
    maps::{bucket::monotonic_ns, PinnedMaps},
};

/// The sync loop over the Redis store.
pub struct ExchangeLoop {
    /// The agent's rules in force.
    pub rules: watch::Receiver<Arc<CompiledRuleSet>>,
    /// The store's client.
    pub store: RedisStore,
    /// Our own handles on the pinned maps.
    pub maps: PinnedMaps,
    /// Shared with the agent.
    pub shared: Arc<Shared>,
    /// The sync interval and the periods derived from it.
    pub timing: Timing,
    /// Cap on the keys written (and so read) per round.
    pub max_keys: usize,
    /// `[cluster] cluster_id`.
    pub cluster_id: String,
    /// This agent's node id and incarnation.
    pub node: (String, u64),
}

/// The other holders' fields of a key, as last read, and when (`CLOCK_MONOTONIC` ns).
pub struct Reading {
    /// The other holders' fields, as the key's script returned them.
    pub fields: Vec<Field>,
    /// When they were read.
    pub read_ns: u64,
}

impl ExchangeLoop {
    /// Runs until the task is aborted.
    pub async fn run(self) {
        let mut rounds = Rounds::start(self);
        let mut tick = tokio::time::interval(rounds.timing.interval());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let due = tick.tick().await;
            if rounds.round(due).await.is_none() {
                return;
            }
        }
    }
}

/// The loop's state from round to round, and what every round is handed.
struct Rounds {
    in_force: watch::Receiver<Arc<CompiledRuleSet>>,
    store: RedisStore,
    shared: Arc<Shared>,
    timing: Timing,
    max_keys: usize,
    cluster_id: String,
    node: (String, u64),
    /// The bucket store's side, handed to a blocking thread for each step that reads or writes it.
    blocking: Option<StoreSide>,
    lag_ns: u64,
    stale_ms: u64,
    ttl_ms: u64,
    readings: HashMap<KeyName, Reading>,
    members: Vec<(String, u64)>,
    members_read_ns: u64,
    /// The store's clock, as last read, and when (here): this host's figures are kept by it.
    server: Option<(u64, u64)>,
    own_figures: OwnFigures,
    last_round_ns: Option<u64>,
    was_up: Option<bool>,
    /// Withheld refill is credited per peer only under gossip; this one stays empty.
    no_tracker: RemoteTracker<ChitchatId>,
}

impl Rounds {
    /// Clears the shares an earlier agent left, then sets up the state of the first round.
    fn start(l: ExchangeLoop) -> Self {
        let ExchangeLoop {
            rules: in_force,
            store,
            mut maps,
            shared,
            timing,
            max_keys,
            cluster_id,
            node,
        } = l;
        let start_ns = monotonic_ns();
        clear_earlier_shares(&mut maps);
        let blocking = Some(StoreSide::new(maps, max_keys, start_ns));
        let lag_ns = timing.lag_ns();
        let stale_ms = timing.stale_ns() / 1_000_000;
        // A key's hash outlives its stale limit a little: a field is dropped by the script
        // before the key would expire under a live holder.
        let ttl_ms = stale_ms.saturating_mul(2);
        Self {
            in_force,
            store,
            shared,
            timing,
            max_keys,
            cluster_id,
            node,
            blocking,
            lag_ns,
            stale_ms,
            ttl_ms,
            readings: HashMap::new(),
            members: Vec::new(),
            members_read_ns: start_ns,
            server: None,
            own_figures: OwnFigures::default(),
            last_round_ns: None,
            was_up: None,
            no_tracker: RemoteTracker::new(0, 0, 0),
        }
    }

    /// One round, its steps in order; `due` is when its tick fell due. `None` when a step on the
    /// blocking thread panicked: the loop stops (logged there).
    async fn round(&mut self, due: tokio::time::Instant) -> Option<()> {
        let began = Instant::now();
        let rules = ClusterRules::of(&self.in_force.borrow());

        // 1. Local buckets -> this host's demand per key.
        let (names, entries, fresh_demand) = self.observe(&rules).await?;

        // 2. Exchange with the store: this host's demand out, the other holders' in.
        let now = self.exchange(names, &entries).await;

        // 3. Demand -> shares, as under gossip.
        let (heaviest, lapsed_ns) = self.set_shares(rules, fresh_demand, now).await?;
        count_late(&self.shared, due.elapsed(), &self.timing, lapsed_ns);

        // 4. Status: the members seen lately, the keys, the store.
        self.show(now, heaviest, began);
        Some(())
    }

    /// Reads the local buckets: this host's demand per key, and the keys it holds (at most
    /// `max_keys`, the heaviest first) with their demand as the store's entries name them;
    /// `None` if the blocking thread panicked.
    async fn observe(
        &mut self,
        rules: &ClusterRules,
    ) -> Option<(Vec<KeyName>, Vec<Entry>, Demand)> {
        let b = self.blocking.take()?;
        let (b, _, _, fresh_demand) = observe_off_thread(b, rules.clone(), self.timing).await?;
        let mut held: Vec<(&KeyName, f64)> = b
            .local
            .keys()
            .filter(|k| rules.limit_of(k).is_some())
            .filter_map(|k| fresh_demand.get(k).map(|&d| (k, d)))
            .collect();
        held.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        held.truncate(self.max_keys);
        let names: Vec<KeyName> = held.iter().map(|(k, _)| (*k).clone()).collect();
        let entries: Vec<Entry> = held
            .iter()
            .map(|(k, d)| Entry {
                key: key_name(&self.cluster_id, &k.rule, k.limit, k.addr),
                demand: *d,
            })
            .collect();
        let c = &self.shared.counters;
        c.keys_published
            .store(b.local.len() as u64, std::sync::atomic::Ordering::Relaxed);
        self.blocking = Some(b);
        Some((names, entries, fresh_demand))
    }

    /// Writes `entries` (the demand of the keys `names`, in order) to the store and takes in what
    /// it returns; when it cannot be reached, what was read before is kept (to go stale). Shows
    /// and logs the store's state. Returns when the answer came (`CLOCK_MONOTONIC` ns).
    async fn exchange(&mut self, names: Vec<KeyName>, entries: &[Entry]) -> u64 {
        let exchanged = self
            .store
            .exchange(entries, self.stale_ms, self.ttl_ms)
            .await;
        let now = monotonic_ns();
        let up = exchanged.is_ok();
        match exchanged {
            Ok(x) => {
                Counters::add(&self.shared.counters.readings_refused, x.refused);
                self.server = Some((x.server_ms, now));
                self.readings.clear();
                for (name, fields) in names.into_iter().zip(x.fields) {
                    self.readings.insert(
                        name,
                        Reading {
                            fields,
                            read_ns: now,
                        },
                    );
                }
                self.members = x.members;
                self.members_read_ns = now;
                store_round(&self.shared, &self.store, Ok(x.rtt_ms));
            }
            Err(e) => store_round(&self.shared, &self.store, Err(e)),
        }
        log_change(&mut self.was_up, up, &self.shared);
        now
    }

    /// Sets each held key's share from this host's demand over the holders' (as under gossip),
    /// and counts what the shares withheld. Returns the heaviest keys whose share was set and
    /// how long the shares written before had lapsed (ns); `None` if the blocking thread panicked.
    async fn set_shares(
        &mut self,
        rules: ClusterRules,
        fresh_demand: Demand,
        now: u64,
    ) -> Option<(HeaviestKeys, u64)> {
        let c = &self.shared.counters;
        let rules_limits = rules.limits();
        let (round, oldest_age) = round_of(&self.readings, &rules_limits, now, self.stale_ms);
        let server_ms = self
            .server
            .map(|(ms, at)| ms + now.saturating_sub(at) / 1_000_000);
        let oldest_peer = server_ms.zip(oldest_age).map(|(s, a)| s.saturating_sub(a));
        c.keys_synced
            .store(round.keys_synced, std::sync::atomic::Ordering::Relaxed);
        let elapsed = self.last_round_ns.map_or(0, |t| now.saturating_sub(t));
        self.last_round_ns = Some(now);
        // Every host divides by the same figures: its own as of the oldest peer's write
        // (see `OwnFigures::to_divide_by`), by the store's clock.
        let local_demand =
            self.own_figures
                .to_divide_by(server_ms.unwrap_or(0), fresh_demand, oldest_peer);
        let mut heaviest = HeaviestKeys::default();
        let mut lapsed_ns = 0;
        if elapsed > 0 && !local_demand.is_empty() {
            let b = self.blocking.take()?;
            let (b, w) =
                set_shares_off_thread(b, rules, round, local_demand, 1.0, elapsed, self.lag_ns)
                    .await?;
            self.blocking = Some(b);
            lapsed_ns = w.lapsed_ns;
            heaviest = count_withheld(w, &mut self.no_tracker, c);
        }
        Some((heaviest, lapsed_ns))
    }

    /// Shows the round in the status: the members seen in the store lately, the heaviest keys,
    /// the hosts heard; and counts the round.
    fn show(&self, now: u64, heaviest: HeaviestKeys, began: Instant) {
        let c = &self.shared.counters;
        let extra_ms = now.saturating_sub(self.members_read_ns) / 1_000_000;
        let peers = peer_statuses(&self.members, extra_ms, self.stale_ms, &self.readings);
        count_sync(c, &peers, began);
        let heard = 1 + peers.iter().filter(|p| p.counted).count() as u64;
        let mut view = self.shared.view();
        view.peers = peers;
        view.keys = heaviest.into_status(&self.node.0, self.node.1);
        view.hosts_heard = heard;
        view.hosts_known = heard;
        view.budget_share = 1.0;
    }
}

/// The round the shares are computed from: per key this host holds, each other holder whose
/// field is within the stale limit (as read, plus the time since) holds it, and its demand if
/// above 0; and the age (ms) of the oldest of the holders' latest writes, for this host's own
/// figure ([`OwnFigures::as_of`]). Public for the bench's `redis` case, which runs many hosts' rounds in one process
/// and divides the budget as this loop does.
pub fn round_of(
    readings: &HashMap<KeyName, Reading>,
    limits: &crate::cluster::remote::ClusterLimits,
    now: u64,
    stale_ms: u64,
) -> (Round<ChitchatId>, Option<u64>) {
    let mut round = Round::default();
    let mut latest: HashMap<&str, u64> = HashMap::new();
    for (name, r) in readings {
        if limits.get(name).is_none() {
            continue;
        }
        let since_ms = now.saturating_sub(r.read_ns) / 1_000_000;
        for f in &r.fields {
            let age = f.age_ms.saturating_add(since_ms);
            if age > stale_ms {
                continue;
            }
            round.keys_synced += u64::from(f.holders);
            *round.holders.entry(name.clone()).or_default() += f.holders;
            if f.demand > 0.0 {
                round
                    .demand
                    .entry(name.clone())
                    .or_default()
                    .push((peer_id(&f.node, f.generation), f.demand));
            }
            let e = latest.entry(f.node.as_str()).or_insert(u64::MAX);
            *e = (*e).min(age);
        }
    }
    // The oldest peer's latest write: the largest of their smallest ages.
    round.counted_peers = latest.len() as u64;
    (round, latest.values().copied().max())
}

/// A peer as the shared code names one: its node id and incarnation, at the address its node id
/// ends with (`hostname/ADDRESS`), port 0.
fn peer_id(node: &str, generation: u64) -> ChitchatId {
    let ip = node
        .rsplit_once('/')
        .and_then(|(_, a)| a.parse::<IpAddr>().ok())
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    ChitchatId::new(node.to_string(), generation, SocketAddr::new(ip, 0))
}

/// The members seen in the store lately: `alive` and counted within the stale limit, `silent`
/// after; with the keys each holds among this host's.
fn peer_statuses(
    members: &[(String, u64)],
    extra_ms: u64,
    stale_ms: u64,
    readings: &HashMap<KeyName, Reading>,
) -> Vec<PeerStatus> {
    let mut keys: HashMap<&str, (usize, u64)> = HashMap::new();
    for r in readings.values() {
        for f in &r.fields {
            let e = keys.entry(f.node.as_str()).or_default();
            e.0 += 1;
            e.1 = f.generation;
        }
    }
    let mut out: BTreeMap<String, PeerStatus> = BTreeMap::new();
    for (node, age) in members {
        let age = age.saturating_add(extra_ms);
        let alive = age <= stale_ms;
        let (n, generation) = keys.get(node.as_str()).copied().unwrap_or_default();
        let id = peer_id(node, generation);
        out.insert(
            node.clone(),
            PeerStatus {
                node_id: node.clone(),
                generation,
                addr: id.gossip_advertise_addr,
                state: if alive { "alive" } else { "silent" },
                counted: alive,
                last_heard_ms: Some(age),
                lag_ms: Some(i64::try_from(age).unwrap_or(i64::MAX)),
                keys: n,
                stored_keys: n,
                charged_pkts: 0,
                charged_bytes: 0,
                clamped: 0,
            },
        );
    }
    out.into_values().collect()
}

/// Shows a round's exchange with the store: its round trip, or its error.
fn store_round(shared: &Shared, store: &RedisStore, result: Result<f64, String>) {
    let mut view = shared.view();
    let s = view.store.get_or_insert_with(StoreStatus::default);
    s.mode = store.mode;
    s.shards = store.shards;
    match result {
        Ok(rtt) => {
            s.state = "connected";
            s.rtt_ms = Some(rtt);
            s.round_trips += 1;
        }
        Err(e) => {
            s.state = "down";
            s.errors += 1;
            s.last_error = Some(e);
            s.last_error_unix_ms = Some(crate::cluster::unix_ms());
        }
    }
}

/// Logs the store becoming reachable or unreachable (once per change, not per round).
fn log_change(was_up: &mut Option<bool>, up: bool, shared: &Shared) {
    if *was_up == Some(up) {
        return;
    }
    let error = shared
        .view()
        .store
        .as_ref()
        .and_then(|s| s.last_error.clone())
        .unwrap_or_default();
    if up {
        tracing::info!("cluster store reached: exchanging demand through Redis");
    } else {
        tracing::warn!(error = %error, "cluster store unreachable: peers' demand goes stale and every share lapses to the whole rate (fail open) until it is reached again");
    }
    *was_up = Some(up);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::remote::{ClusterLimits, Limits};

    fn field(node: &str, demand: f64, age_ms: u64) -> Field {
        Field {
            node: node.into(),
            generation: 7,
            demand,
            age_ms,
            holders: 1,
        }
    }

    /// A holder's field counts while it is within the stale limit, counting the time since it
    /// was read (a store that cannot be reached leaves the figures read before to go stale as a
    /// silent gossip peer's do); one with no demand holds the key without demand; keys of limits
    /// not cluster-scoped here are left out; the oldest holder's latest write is what this
    /// host's own figure is taken as of.
    #[test]
    fn the_stores_fields_are_read_as_gossips_counted_peers_and_go_stale_alike() {
        let key = |addr: &str| KeyName {
            rule: "web".into(),
            limit: 0,
            addr: addr.parse().unwrap(),
        };
        let limits = ClusterLimits::default().with(
            "web",
            0,
            Limits {
                pkt_interval_ns: 1_000_000,
                pkt_tolerance_ns: 0,
                byte_interval_fp: 0,
                byte_tolerance_ns: 0,
            },
        );
        let read_ns = 10_000_000_000;
        let mut readings = HashMap::new();
        readings.insert(
            key("198.18.0.7"),
            Reading {
                fields: vec![
                    field("h/198.18.1.2", 300.0, 100),
                    field("h/198.18.1.3", 0.0, 50),
                    field("h/198.18.1.4", 900.0, 600),
                ],
                read_ns,
            },
        );
        let mut other = key("198.18.0.8");
        other.rule = "local-only".into();
        readings.insert(
            other.clone(),
            Reading {
                fields: vec![field("h/198.18.1.2", 50.0, 0)],
                read_ns,
            },
        );
        let (round, age) = round_of(&readings, &limits, read_ns, 500);
        let k = key("198.18.0.7");
        assert_eq!(
            round.hosts_holding(&k),
            3,
            "this host and the two fresh fields"
        );
        assert!((round.peer_demand(&k) - 300.0).abs() < 1e-9);
        assert_eq!(
            round.demand[&k][0].0.gossip_advertise_addr.ip().to_string(),
            "198.18.1.2"
        );
        assert_eq!(
            round.hosts_holding(&other),
            1,
            "not a cluster-scoped limit here"
        );
        assert_eq!(
            age,
            Some(100),
            "the oldest of the fresh holders' latest writes"
        );
        // 450 ms later (no new reading: the store is down), the 100 ms old field is stale too,
        // the idle one not yet; 50 ms more and this host holds the key alone (the whole rate).
        let (round, _) = round_of(&readings, &limits, read_ns + 450_000_000, 500);
        assert_eq!((round.hosts_holding(&k), round.peer_demand(&k)), (2, 0.0));
        let (round, age) = round_of(&readings, &limits, read_ns + 460_000_000, 500);
        assert_eq!((round.hosts_holding(&k), age), (1, None));
    }

    #[test]
    fn members_seen_lately_are_alive_and_counted_then_silent() {
        let mut readings = HashMap::new();
        readings.insert(
            KeyName {
                rule: "web".into(),
                limit: 0,
                addr: "198.18.0.7".parse().unwrap(),
            },
            Reading {
                fields: vec![field("h/198.18.1.2", 1.0, 0)],
                read_ns: 0,
            },
        );
        let members = vec![
            ("h/198.18.1.2".to_string(), 100),
            ("h/198.18.1.3".to_string(), 450),
        ];
        let p = peer_statuses(&members, 100, 500, &readings);
        assert_eq!(p.len(), 2);
        assert_eq!(
            (
                p[0].state,
                p[0].counted,
                p[0].keys,
                p[0].generation,
                p[0].addr.to_string()
            ),
            ("alive", true, 1, 7, "198.18.1.2:0".to_string())
        );
        assert_eq!((p[1].state, p[1].counted, p[1].keys), ("silent", false, 0));
    }
}
