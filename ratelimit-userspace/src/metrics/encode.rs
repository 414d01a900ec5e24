//! The OpenMetrics encoding of a [`Snapshot`]: one `prometheus-client` collector writing every
//! family from the snapshot's figures.

use std::{collections::BTreeMap, fmt};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge, info::Info},
};
use ratelimit_common::{global, verdict};

use super::{InterfaceSnapshot, Snapshot, GLOBAL_COUNTERS, PARSE_FAILURES, SHAPE_DROPS};
use crate::cluster::{status::StoreStatus, ClusterStatus, CounterValues};
use crate::stats::{BucketReport, LimitReport, RuleReport};

/// Writes one metric family: its descriptor, then one sample per label set.
fn family<L, M>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, M)>,
) -> Result<(), fmt::Error>
where
    L: prometheus_client::encoding::EncodeLabelSet,
    M: EncodeMetric,
{
    let mut samples = samples.into_iter().peekable();
    let Some((_, first)) = samples.peek() else {
        return Ok(());
    };
    let mut metric = encoder.encode_descriptor(name, help, None, first.metric_type())?;
    for (labels, value) in samples {
        value.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The cluster sync's metrics (`ratelimit_cluster_*`), one group of families after the other
/// in the order /metrics lists them.
fn encode_cluster(enc: &mut DescriptorEncoder, cluster: &ClusterStatus) -> Result<(), fmt::Error> {
    let c = &cluster.counters;
    encode_gossip_traffic(enc, c)?;
    encode_peer_states(enc, cluster)?;
    encode_keys_and_charges(enc, c)?;
    encode_sync_rounds(enc, c)?;
    encode_loop_health(enc, cluster)?;
    if let Some(store) = &cluster.store {
        encode_store(enc, store)?;
    }
    encode_partition(enc, cluster)?;
    encode_key_shares(enc, cluster)
}

/// Gossip datagrams and bytes by direction, datagrams rejected by reason, digest ids stripped,
/// probes withheld and failed sends.
fn encode_gossip_traffic(enc: &mut DescriptorEncoder, c: &CounterValues) -> Result<(), fmt::Error> {
    family(
        enc,
        "ratelimit_cluster_messages",
        "Gossip datagrams by direction: in (authentic, fresh, well-formed) and out.",
        [("in", c.messages_in), ("out", c.messages_out)]
            .map(|(d, n)| (vec![("direction", d)], ConstCounter::new(n))),
    )?;
    family(
        enc,
        "ratelimit_cluster_bytes",
        "Gossip bytes by direction (every received datagram counted, accepted or not).",
        [("in", c.bytes_in), ("out", c.bytes_out)]
            .map(|(d, n)| (vec![("direction", d)], ConstCounter::new(n))),
    )?;
    family(
        enc,
        "ratelimit_cluster_rejected",
        "Gossip datagrams dropped: auth (tag did not verify: wrong key or cluster id), stale (too \
         old, from the future, replayed), malformed, late (waited in this host's socket longer \
         than a sync interval: the agent was behind), unsafe (authentic, but what would crash \
         or corrupt the gossip library: see cluster::inspect).",
        [
            ("auth", c.rejected_auth),
            ("stale", c.rejected_stale),
            ("malformed", c.rejected_malformed),
            ("late", c.rejected_late),
            ("unsafe", c.rejected_unsafe),
        ]
        .map(|(r, n)| (vec![("reason", r)], ConstCounter::new(n))),
    )?;
    single(
        enc,
        "ratelimit_cluster_digest_ids_stripped",
        "Member ids left out of authentic gossip digests: new ids beyond what their sender may \
         introduce (see cluster::inspect::Introductions).",
        &ConstCounter::new(c.digest_ids_stripped),
    )?;
    single(
        enc,
        "ratelimit_cluster_probes_withheld",
        "Gossip messages not sent to an address that has not answered lately, beyond a probe a \
         second to each and four a second in all (see cluster::transport).",
        &ConstCounter::new(c.probes_withheld),
    )?;
    single(
        enc,
        "ratelimit_cluster_send_errors",
        "Gossip sends that failed.",
        &ConstCounter::new(c.send_errors),
    )
}

/// The other members by state (`ratelimit_cluster_peers`), each of the four states always listed.
fn encode_peer_states(
    enc: &mut DescriptorEncoder,
    cluster: &ClusterStatus,
) -> Result<(), fmt::Error> {
    let mut states: BTreeMap<&str, i64> = ["alive", "joining", "silent", "dead"]
        .into_iter()
        .map(|s| (s, 0))
        .collect();
    for p in &cluster.peers {
        *states.entry(p.state).or_default() += 1;
    }
    family(
        enc,
        "ratelimit_cluster_peers",
        "Other members by state; only alive peers' demand takes a share.",
        states
            .into_iter()
            .map(|(st, n)| (vec![("state", st)], ConstGauge::new(n))),
    )
}

/// Keys published, synced and dropped, and the refill withheld for the peers' shares.
fn encode_keys_and_charges(
    enc: &mut DescriptorEncoder,
    c: &CounterValues,
) -> Result<(), fmt::Error> {
    single(
        enc,
        "ratelimit_cluster_keys_published",
        "Keys (heavy sources) this agent publishes.",
        &ConstGauge::new(c.keys_published),
    )?;
    single(
        enc,
        "ratelimit_cluster_keys_synced",
        "Keys read from counted peers in the last sync.",
        &ConstGauge::new(c.keys_synced),
    )?;
    single(
        enc,
        "ratelimit_cluster_keys_dropped",
        "Peer keys ignored beyond the per-peer cap.",
        &ConstCounter::new(c.keys_dropped),
    )?;
    single(
        enc,
        "ratelimit_cluster_charged_packets",
        "Refill withheld from local buckets for the peers' shares, in packets.",
        &ConstCounter::new(c.charged_pkts),
    )?;
    single(
        enc,
        "ratelimit_cluster_charged_bytes",
        "Refill withheld from local buckets for the peers' shares, in bytes.",
        &ConstCounter::new(c.charged_bytes),
    )
}

/// How the sync rounds went: readings refused, charges clamped, rounds late, debt capped and
/// the sync lag.
fn encode_sync_rounds(enc: &mut DescriptorEncoder, c: &CounterValues) -> Result<(), fmt::Error> {
    single(
        enc,
        "ratelimit_cluster_readings_refused",
        "Readings of peers' gossip refused as impossible (dated ahead, sequence, epoch or counter going back).",
        &ConstCounter::new(c.readings_refused),
    )?;
    single(
        enc,
        "ratelimit_cluster_charges_clamped",
        "Sync rounds late by more than 3 intervals, whose withheld refill was cut to that.",
        &ConstCounter::new(c.charges_clamped),
    )?;
    single(
        enc,
        "ratelimit_cluster_rounds_late",
        "Sync rounds whose shares landed more than a quarter sync interval after they were due.",
        &ConstCounter::new(c.rounds_late),
    )?;
    single(
        enc,
        "ratelimit_cluster_debt_capped",
        "Withheld refill cut short by a bucket's ceiling (tolerance + 3 sync intervals).",
        &ConstCounter::new(c.debt_capped),
    )?;
    #[expect(clippy::cast_precision_loss, reason = "milliseconds as seconds")]
    single(
        enc,
        "ratelimit_cluster_sync_lag_seconds",
        "Largest age of the newest demand data from a counted peer at the last sync.",
        &ConstGauge::new(c.sync_lag_ms as f64 / 1000.0),
    )
}

/// Restarts of the gossip and sync loops, and whether the gossip loop runs.
fn encode_loop_health(
    enc: &mut DescriptorEncoder,
    cluster: &ClusterStatus,
) -> Result<(), fmt::Error> {
    let c = &cluster.counters;
    single(
        enc,
        "ratelimit_cluster_gossip_restarts",
        "Restarts of the gossip loop attempted after a socket error ended it.",
        &ConstCounter::new(c.gossip_restarts),
    )?;
    single(
        enc,
        "ratelimit_cluster_sync_restarts",
        "Restarts of the cluster sync loop after it ended (a panic in a round).",
        &ConstCounter::new(c.sync_restarts),
    )?;
    single(
        enc,
        "ratelimit_cluster_gossip_up",
        "1 while the gossip loop runs, 0 while it is being restarted.",
        &ConstGauge::new(u64::from(cluster.gossip != "restarting")),
    )
}

/// The Redis store's state, round trips, errors and round trip time (`ratelimit_cluster_store_*`).
fn encode_store(enc: &mut DescriptorEncoder, store: &StoreStatus) -> Result<(), fmt::Error> {
    single(
        enc,
        "ratelimit_cluster_store_up",
        "1 while the last sync round reached the Redis store (backend = redis), else 0.",
        &ConstGauge::new(u64::from(store.state == "connected")),
    )?;
    single(
        enc,
        "ratelimit_cluster_store_round_trips",
        "Sync rounds that exchanged their demand with the Redis store.",
        &ConstCounter::new(store.round_trips),
    )?;
    single(
        enc,
        "ratelimit_cluster_store_errors",
        "Sync rounds and connection attempts that failed to reach the Redis store.",
        &ConstCounter::new(store.errors),
    )?;
    single(
        enc,
        "ratelimit_cluster_store_rtt_seconds",
        "Round trip of the last sync round's exchange with the Redis store.",
        &ConstGauge::new(store.rtt_ms.unwrap_or(0.0) / 1000.0),
    )
}

/// Hosts heard and known, the budget share this host enforces with them, and the refill withheld
/// for hosts known but not heard.
fn encode_partition(
    enc: &mut DescriptorEncoder,
    cluster: &ClusterStatus,
) -> Result<(), fmt::Error> {
    let c = &cluster.counters;
    family(
        enc,
        "ratelimit_cluster_hosts",
        "Hosts heard now (this one and the peers counted) and hosts last known alive (heard \
         within partition_memory_s).",
        [
            ("heard", cluster.hosts_heard),
            ("known", cluster.hosts_known),
        ]
        .map(|(v, n)| (vec![("view", v)], ConstGauge::new(n))),
    )?;
    single(
        enc,
        "ratelimit_cluster_budget_share",
        "Share of each cluster budget this host enforces with the hosts it hears (heard / known \
         under on_partition = share, else 1).",
        &ConstGauge::new(cluster.budget_share),
    )?;
    single(
        enc,
        "ratelimit_cluster_share_charged_packets",
        "Refill withheld for hosts known but not heard (on_partition = share), in packets.",
        &ConstCounter::new(c.share_charged_pkts),
    )
}

/// Per key of the heaviest (`ClusterStatus::keys`: at most `SHOWN_KEYS`, 10, by cluster
/// demand) and per holder named (this host and its counted peers with demand for the key, at
/// most `MAX_PEERS`, 64): the label sets are bounded, at most 10 x 65 series per gauge, however
/// many sources and members there are.
fn encode_key_shares(
    enc: &mut DescriptorEncoder,
    cluster: &ClusterStatus,
) -> Result<(), fmt::Error> {
    let limits: Vec<String> = cluster.keys.iter().map(|k| k.limit.to_string()).collect();
    let key_labels = |i: usize| -> Labels<'_> {
        let k = &cluster.keys[i];
        vec![
            ("rule", k.rule.as_str()),
            ("limit", limits[i].as_str()),
            ("key", k.key.as_str()),
        ]
    };
    let per_holder = |value: fn(&crate::cluster::HolderStatus) -> f64| {
        cluster.keys.iter().enumerate().flat_map(move |(i, k)| {
            k.holders.iter().map(move |h| {
                let mut labels = key_labels(i);
                labels.push(("holder", h.node_id.as_str()));
                (labels, ConstGauge::new(value(h)))
            })
        })
    };
    family(
        enc,
        "ratelimit_cluster_key_hosts",
        "Hosts holding each of the heaviest cluster keys whose share this host sets (this one \
         and the counted peers publishing it): its budget is divided between them.",
        (0..cluster.keys.len()).map(|i| {
            (
                key_labels(i),
                ConstGauge::new(i64::from(cluster.keys[i].hosts)),
            )
        }),
    )?;
    family(
        enc,
        "ratelimit_cluster_key_demand_pps",
        "Demand (packets per second reaching its bucket, admitted or dropped) of each holder of \
         the heaviest cluster keys: this host and each counted peer with demand for the key.",
        per_holder(|h| h.demand_pps),
    )?;
    family(
        enc,
        "ratelimit_cluster_key_share",
        "Share of the budget of each of the heaviest cluster keys per holder, as this host \
         computes it (a holder's bucket refills at share x rate; the shares add up to 1).",
        per_holder(|h| h.share),
    )?;
    Ok(())
}

/// Writes one metric without labels.
fn single(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: &impl EncodeMetric,
) -> Result<(), fmt::Error> {
    value.encode(encoder.encode_descriptor(name, help, None, value.metric_type())?)
}

type Labels<'a> = Vec<(&'static str, &'a str)>;

impl Collector for Snapshot {
    /// Every family, one group after the other in the order /metrics lists them.
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), fmt::Error> {
        let s = &self.stats;
        encode_rule_verdicts(&mut enc, &s.rules)?;
        encode_limit_drops(&mut enc, &s.rules)?;
        encode_globals(&mut enc, &s.global)?;
        encode_buckets(&mut enc, &s.buckets)?;
        family(
            &mut enc,
            "ratelimit_reloads",
            "Rule-set changes (config file reloads, SIGHUP, API) by result: ok (applied) or failed \
             (refused; the rules in force stayed).",
            [("ok", self.reloads_ok), ("failed", self.reloads_failed)]
                .map(|(result, n)| (vec![("result", result)], ConstCounter::new(n))),
        )?;
        if let Some(cluster) = &self.cluster {
            encode_cluster(&mut enc, cluster)?;
        }
        encode_endpoint_and_build(&mut enc, self.encodings, &self.version)?;
        encode_interfaces(&mut enc, &self.interfaces)?;
        encode_learned(&mut enc, &self.learned)
    }
}

/// Packets and bytes that matched each rule, by verdict (`ratelimit_rule_packets`, `_bytes`).
fn encode_rule_verdicts(
    enc: &mut DescriptorEncoder,
    rules: &[RuleReport],
) -> Result<(), fmt::Error> {
    let per_rule = |pick: fn(&RuleReport) -> &BTreeMap<&'static str, u64>| {
        rules.iter().flat_map(move |r| {
            verdict::NAMES.iter().map(move |v| {
                let labels: Labels = vec![("rule", r.name.as_str()), ("verdict", v)];
                (
                    labels,
                    ConstCounter::new(pick(r).get(v).copied().unwrap_or(0)),
                )
            })
        })
    };
    family(
        enc,
        "ratelimit_rule_packets",
        "Packets that matched each rule, by verdict: passed (within the limit), allowed (allow \
         rule), dropped_rate, dropped_bytes, denied (deny rule), dry_run (would have been dropped; \
         passed), no_bucket (no bucket could be created; passed). The XDP program counts per \
         rule, not per interface.",
        per_rule(|r| &r.packets),
    )?;
    family(
        enc,
        "ratelimit_rule_bytes",
        "Bytes (whole frames, Ethernet header included) that matched each rule, by verdict (see ratelimit_rule_packets).",
        per_rule(|r| &r.bytes),
    )?;
    Ok(())
}

/// Packets dropped by each limit of each limit rule, by verdict (`ratelimit_limit_dropped_packets`).
fn encode_limit_drops(enc: &mut DescriptorEncoder, rules: &[RuleReport]) -> Result<(), fmt::Error> {
    let limit_names: Vec<(String, &RuleReport, &LimitReport)> = rules
        .iter()
        .flat_map(|r| r.limits.iter().map(move |l| (l.limit.to_string(), r, l)))
        .collect();
    family(
        enc,
        "ratelimit_limit_dropped_packets",
        "Packets dropped by each limit of each limit rule (1: the rule's own, 2..: its \
         [[rule.limit]]s in order), by verdict: dropped_rate or dropped_bytes. The sum over a \
         rule's limits is its ratelimit_rule_packets of that verdict.",
        limit_names.iter().flat_map(|(n, r, l)| {
            [
                ("dropped_rate", l.dropped_rate),
                ("dropped_bytes", l.dropped_bytes),
            ]
            .into_iter()
            .map(move |(v, c)| {
                let labels: Labels = vec![
                    ("rule", r.name.as_str()),
                    ("limit", n.as_str()),
                    ("verdict", v),
                ];
                (labels, ConstCounter::new(c))
            })
        }),
    )
}

/// The program-wide counters: packets, parse failures by reason, the other global counters,
/// shape drops by reason and bucket evictions by state.
fn encode_globals(
    enc: &mut DescriptorEncoder,
    global: &BTreeMap<&'static str, u64>,
) -> Result<(), fmt::Error> {
    let g = |i: usize| global.get(global::NAMES[i]).copied().unwrap_or(0);
    let (packets, name, help) = GLOBAL_COUNTERS[0];
    single(enc, name, help, &ConstCounter::new(g(packets)))?;
    family(
        enc,
        "ratelimit_parse_failures",
        "Frames the XDP program could not parse, by reason: passed unclassified (truncated_l4: \
         classified without ports).",
        PARSE_FAILURES
            .iter()
            .map(|&i| (vec![("reason", global::NAMES[i])], ConstCounter::new(g(i)))),
    )?;
    for &(i, name, help) in &GLOBAL_COUNTERS[1..] {
        single(enc, name, help, &ConstCounter::new(g(i)))?;
    }
    family(
        enc,
        "ratelimit_shape_drops",
        "Packets dropped for how they are cut, where a protocol or port rule could apply to \
         their source, by reason: tiny_fragment (a first fragment without its whole TCP/UDP \
         header, and the rest of its datagram), long_header_chain (an IPv6 chain of more than 8 \
         extension headers, or a first fragment whose chain ends before the L4 header), \
         fragment_conflict (a first fragment sent again with other ports, and the rest of its \
         datagram), vlan_chain (a frame in more VLAN tags than the program walks), \
         unmatched_fragment (a fragment whose first fragment was not seen).",
        SHAPE_DROPS.map(|(i, reason)| (vec![("reason", reason)], ConstCounter::new(g(i)))),
    )?;
    family(
        enc,
        "ratelimit_bucket_evictions",
        "Buckets whose record a new source took, by the evicted bucket's state: full (it had \
         refilled: nothing lost) or lost (it had not: that source starts full again if it \
         comes back). A growing lost count means the store is too small for the sources it \
         sees: raise max_buckets, or add an aggregate rule.",
        [
            ("full", global::EVICTED_FULL),
            ("lost", global::EVICTED_LOST),
        ]
        .map(|(state, i)| (vec![("state", state)], ConstCounter::new(g(i)))),
    )
}

/// The bucket store's occupancy: buckets tracked and its capacity.
fn encode_buckets(enc: &mut DescriptorEncoder, buckets: &BucketReport) -> Result<(), fmt::Error> {
    single(
        enc,
        "ratelimit_buckets_tracked",
        "Token buckets (source, rule) currently tracked.",
        &ConstGauge::new(buckets.tracked),
    )?;
    single(
        enc,
        "ratelimit_buckets_capacity",
        "Capacity of the bucket store (max_buckets, rounded up to a multiple of 64: whole pages of sets); a new source \
         takes the record of an empty, stale or refilled bucket among its 8 candidates, else \
         of the one least in debt (see ratelimit_bucket_evictions).",
        &ConstGauge::new(buckets.capacity),
    )
}

/// This endpoint's encodings so far, then the agent's build information (its version).
fn encode_endpoint_and_build(
    enc: &mut DescriptorEncoder,
    encodings: u64,
    version: &str,
) -> Result<(), fmt::Error> {
    single(
        enc,
        "ratelimit_metrics_encodings",
        "Encodings of this endpoint's reply, this one included: one at a time, each reply \
         shared by the scrapes of the next second (or twice the encoding's time).",
        &ConstCounter::new(encodings),
    )?;
    let info = Info::new(vec![("version", version)]);
    single(enc, "ratelimit_build", "Agent build information.", &info)
}

/// The attached interfaces with their attach mode, then the kernel's receive counters of each.
fn encode_interfaces(
    enc: &mut DescriptorEncoder,
    interfaces: &[InterfaceSnapshot],
) -> Result<(), fmt::Error> {
    family(
        enc,
        "ratelimit_interface_attached",
        "Interfaces the XDP program is attached to, with the attach mode (native, skb, or \
         adopted from a previous agent).",
        interfaces.iter().map(|i| {
            let labels: Labels = vec![("interface", i.name.as_str()), ("mode", i.mode.as_str())];
            (labels, ConstGauge::new(1_i64))
        }),
    )?;
    let kernel_note = "as the kernel reports it in /sys/class/net/IF/statistics (whether packets \
                           the XDP program dropped are included depends on the driver). The XDP \
                           program's own counters are per rule, not per interface: counting per \
                           interface in the fast path would cost a map lookup per packet.";
    let iface_counter = |pick: fn(&InterfaceSnapshot) -> Option<u64>| {
        interfaces.iter().filter_map(move |i| {
            pick(i).map(|n| (vec![("interface", i.name.as_str())], ConstCounter::new(n)))
        })
    };
    family(
        enc,
        "ratelimit_interface_rx_packets",
        &format!("Packets received on each attached interface, {kernel_note}"),
        iface_counter(|i| i.rx_packets),
    )?;
    family(
        enc,
        "ratelimit_interface_rx_dropped",
        &format!("Received packets dropped on each attached interface, {kernel_note}"),
        iface_counter(|i| i.rx_dropped),
    )
}

/// What `suggest` learned (`ratelimit_learned_*`): per learned rule and limit (at most
/// [`crate::learn::MAX_LIMITS`]), three quantiles of its sources' peak rates and bursts over the
/// last hour, and how many sources were seen.
pub(super) fn encode_learned(
    enc: &mut DescriptorEncoder,
    learned: &[crate::learn::Gauges],
) -> Result<(), fmt::Error> {
    use crate::learn::GAUGE_QUANTILES;
    let names: Vec<String> = learned.iter().map(|g| g.limit.to_string()).collect();
    family(
        enc,
        "ratelimit_learned_peak_rate",
        "Quantiles of the sources' peak packet rates over a 1 s or 10 s window, per rule and \
         limit, over the last hour (what `ratelimit suggest` proposes from).",
        learned.iter().zip(&names).flat_map(|(g, n)| {
            [("1s", &g.peak_1s), ("10s", &g.peak_10s)]
                .into_iter()
                .flat_map(move |(w, qs)| {
                    GAUGE_QUANTILES.iter().zip(qs).map(move |(q, v)| {
                        let labels: Labels = vec![
                            ("rule", g.rule.as_str()),
                            ("limit", n.as_str()),
                            ("window", w),
                            ("quantile", q),
                        ];
                        (labels, ConstGauge::new(*v))
                    })
                })
        }),
    )?;
    family(
        enc,
        "ratelimit_learned_burst",
        "Quantiles of the sources' largest bursts (packets of their busiest second beyond their \
         10 s peak rate), per rule and limit, over the last hour.",
        learned.iter().zip(&names).flat_map(|(g, n)| {
            GAUGE_QUANTILES.iter().zip(&g.burst).map(move |(q, v)| {
                let labels: Labels = vec![
                    ("rule", g.rule.as_str()),
                    ("limit", n.as_str()),
                    ("quantile", q),
                ];
                (labels, ConstGauge::new(*v))
            })
        }),
    )?;
    #[expect(clippy::cast_possible_wrap, reason = "a count of sources")]
    family(
        enc,
        "ratelimit_learned_sources",
        "Sources observed per rule and limit over the last hour (once per 5-minute slot each).",
        learned.iter().zip(&names).map(|(g, n)| {
            let labels: Labels = vec![("rule", g.rule.as_str()), ("limit", n.as_str())];
            (labels, ConstGauge::new(g.sources as i64))
        }),
    )
}
