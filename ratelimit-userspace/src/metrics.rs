//! The Prometheus metrics endpoint: `GET /metrics` on the `[agent] metrics` address, in the
//! OpenMetrics text format (which Prometheus negotiates by default).
//!
//! An encoding takes a [`Snapshot`]: the bucket count from the census ([`crate::census`]), the
//! attachments and reload bookkeeping under the agent's lock (copies of a few fields, no system
//! call), then, off the lock on a blocking thread, the counters from the endpoint's own handles
//! on the pinned maps (for the rules in force) and the kernel's interface counters from sysfs,
//! encoded through a `prometheus-client` collector. So the numbers are the maps' own, with no
//! drift between the endpoint and `ratelimit stats`, and no scrape, however frequent, walks the
//! bucket store or holds the lock for more than a moment.
//!
//! What a scrape costs is bounded whatever the number of scrapers ([`ScrapeCache`]): one
//! encoding at a time, and its reply shared by every scrape for [`SHARE_FOR`] after it (or twice
//! the encoding's own time, if longer), so encodings take at most a third of a core and the
//! replies in memory are that one's, shared, not one per scraper. The server caps its
//! connections and times out slow clients ([`crate::http`]).
//!
//! The metric names and labels are part of the user-facing contract (documented in docs/operations.md, "Metrics"):
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `ratelimit_rule_packets_total`, `ratelimit_rule_bytes_total` | counter | `rule`, `verdict` |
//! | `ratelimit_limit_dropped_packets_total` | counter | `rule`, `limit` (1: the rule's own, 2..: its `[[rule.limit]]`s), `verdict` (`dropped_rate`, `dropped_bytes`) |
//! | `ratelimit_packets_total` | counter | |
//! | `ratelimit_parse_failures_total` | counter | `reason` |
//! | `ratelimit_non_ip_packets_total`, `ratelimit_fragments_total`, `ratelimit_unmatched_packets_total`, `ratelimit_new_buckets_total`, `ratelimit_bucket_errors_total`, `ratelimit_internal_errors_total` | counter | |
//! | `ratelimit_buckets_tracked`, `ratelimit_buckets_capacity` | gauge | |
//! | `ratelimit_bucket_evictions_total` | counter | `state` (`full`, `lost`) |
//! | `ratelimit_shape_drops_total` | counter | `reason` (`tiny_fragment`, `long_header_chain`, `fragment_conflict`, `vlan_chain`, `unmatched_fragment`) |
//! | `ratelimit_fragments_unmatched_total`, `ratelimit_long_header_chains_total` | counter | |
//! | `ratelimit_reloads_total` | counter | `result` (`ok`, `failed`) |
//! | `ratelimit_metrics_encodings_total` | counter | |
//! | `ratelimit_build_info` | info | `version` |
//! | `ratelimit_interface_attached` | gauge | `interface`, `mode` |
//! | `ratelimit_interface_rx_packets_total`, `ratelimit_interface_rx_dropped_total` | counter | `interface` |

use std::{fmt, net::SocketAddr, path::Path, sync::Arc, time::Duration};

use serde::Serialize;

use axum::{
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge, info::Info},
    registry::Registry,
};
use ratelimit_common::{global, verdict};

use crate::{
    agent::{Agent, SharedAgent},
    census::ReadSide,
    cluster::{ClusterHandle, ClusterStatus},
    stats::StatsReport,
};

/// Content type of the OpenMetrics text format, which `prometheus-client` writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Global counters exported as `ratelimit_parse_failures_total{reason}`: frames the program could
/// not parse (passed unclassified, or for `truncated_l4` classified without ports: the receiving
/// stack discards them).
const PARSE_FAILURES: [usize; 6] = [
    global::TRUNCATED_ETH,
    global::BAD_VLAN,
    global::TRUNCATED_IPV4,
    global::BAD_IPV4,
    global::BAD_IPV6,
    global::TRUNCATED_L4,
];

/// Global counters exported as `ratelimit_shape_drops_total{reason}`: packets dropped for how they
/// are cut or wrapped, where a protocol or port rule (for VLAN chains, any rule that can drop)
/// could apply to their source.
const SHAPE_DROPS: [(usize, &str); 5] = [
    (global::DROPPED_TINY_FRAGMENTS, "tiny_fragment"),
    (global::DROPPED_LONG_CHAINS, "long_header_chain"),
    (global::DROPPED_FRAGMENT_CONFLICTS, "fragment_conflict"),
    (global::DROPPED_VLAN_CHAINS, "vlan_chain"),
    (global::DROPPED_UNMATCHED_FRAGMENTS, "unmatched_fragment"),
];

/// Global counters exported as a metric of their own: (index, metric name without `_total`, help).
const GLOBAL_COUNTERS: [(usize, &str, &str); 10] = [
    (global::PACKETS, "ratelimit_packets", "Packets the XDP program saw, on every attached interface."),
    (global::NON_IP, "ratelimit_non_ip_packets", "Packets that were neither IPv4 nor IPv6 (ARP, LLDP...): passed."),
    (
        global::FRAGMENTS,
        "ratelimit_fragments",
        "IP fragments other than the first: classified as their datagram's first fragment was.",
    ),
    (
        global::FRAGMENTS_UNMATCHED,
        "ratelimit_fragments_unmatched",
        "IP fragments other than the first whose first fragment was not seen: dropped where a rule that looks \
         at the port could apply (shape_drops, unmatched_fragment), else classified without ports.",
    ),
    (
        global::LONG_CHAINS,
        "ratelimit_long_header_chains",
        "IPv6 packets whose extension header chain the program does not walk to its end, from sources \
         no protocol or port rule applies to: passed.",
    ),
    (global::NO_MATCH, "ratelimit_unmatched_packets", "IP packets that matched no rule: passed."),
    (global::NEW_BUCKETS, "ratelimit_new_buckets", "Token buckets created (one per new source and rule)."),
    (
        global::BUCKET_ERRORS,
        "ratelimit_bucket_errors",
        "Bucket creations that failed: the packet passed (fail open) and counts as verdict no_bucket.",
    ),
    (
        global::INTERNAL,
        "ratelimit_internal_errors",
        "Internal errors of the XDP program (a map lookup that cannot fail did): the packet passed.",
    ),
    (
        global::CONTENDED_FALLBACKS,
        "ratelimit_contended_fallbacks",
        "Bucket charges whose compare-and-swaps all failed under contention, judged by one atomic \
         add: exact unless the bucket was full, then dropped (never admitted beyond the limit).",
    ),
];

/// First wait before binding the metrics address again after it could not be bound; doubled
/// after each failure up to [`MAX_BIND_RETRY`].
pub const MIN_BIND_RETRY: Duration = Duration::from_secs(1);
/// Longest wait between attempts to bind the metrics address.
pub const MAX_BIND_RETRY: Duration = Duration::from_secs(10);

/// The metrics endpoint's health, as `status` shows it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct EndpointStatus {
    /// `[agent] metrics`: the address it serves at, or tries to.
    pub listen: SocketAddr,
    /// `serving`, or `unbound`: the address could not be bound (e.g. another process holds it)
    /// and binding is retried in the background; the limiter enforces meanwhile.
    pub state: &'static str,
    /// Why the last attempt to bind failed, while `unbound`.
    pub error: Option<String>,
    /// Failed attempts to bind so far.
    pub bind_failures: u64,
}

/// The running metrics endpoint, as `status` reads its health.
#[derive(Clone, Debug)]
pub struct MetricsHandle(Arc<std::sync::Mutex<EndpointStatus>>);

impl MetricsHandle {
    /// The endpoint's health now.
    #[must_use]
    pub fn status(&self) -> EndpointStatus {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn update(&self, f: impl FnOnce(&mut EndpointStatus)) {
        f(&mut self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner));
    }
}

/// Serves `GET /metrics` at `addr` until the task is aborted.
///
/// Never fails: an address that cannot be bound (in use by another process, say) must neither
/// keep the limiter from starting nor take down what it enforces. The error is logged, naming
/// the address, `status` shows the endpoint `unbound` with the error, and binding is retried in
/// the background (from [`MIN_BIND_RETRY`], doubling up to [`MAX_BIND_RETRY`]) until it succeeds.
pub async fn serve(
    addr: SocketAddr,
    agent: SharedAgent,
    cluster: Option<ClusterHandle>,
    read: ReadSide,
) -> (MetricsHandle, tokio::task::JoinHandle<()>) {
    let handle = MetricsHandle(Arc::new(std::sync::Mutex::new(EndpointStatus {
        listen: addr,
        state: "unbound",
        error: None,
        bind_failures: 0,
    })));
    let app = Router::new()
        .route("/metrics", get(scrape))
        .with_state(ScrapeState {
            agent,
            cluster,
            read,
            cache: Arc::default(),
        });
    // The first attempt before returning: once the agent says it runs, the endpoint is up, or
    // its failure is logged and in the status.
    let mut wait = MIN_BIND_RETRY;
    let first = match bind(addr).await {
        Ok(listener) => Some(bound(&handle, listener, addr)),
        Err(e) => {
            bind_failed(&handle, addr, &e, wait);
            None
        }
    };
    let health = handle.clone();
    let task = tokio::spawn(async move {
        let listener = match first {
            Some(listener) => listener,
            None => loop {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(MAX_BIND_RETRY);
                match bind(addr).await {
                    Ok(listener) => break bound(&health, listener, addr),
                    Err(e) => bind_failed(&health, addr, &e, wait),
                }
            },
        };
        crate::http::serve(
            listener,
            app,
            crate::http::Limits {
                takes_body: crate::http::no_body,
                ..crate::http::Limits::default()
            },
            "metrics endpoint",
        )
        .await;
    });
    (handle, task)
}

/// What a scrape reads.
#[derive(Clone)]
struct ScrapeState {
    agent: SharedAgent,
    cluster: Option<ClusterHandle>,
    read: ReadSide,
    cache: Arc<ScrapeCache>,
}

/// How long an encoding's reply serves every scrape (at least: see [`ScrapeCache`]). Prometheus
/// scrapes every 10-60 s; a second is below any useful resolution.
pub const SHARE_FOR: Duration = Duration::from_secs(1);

/// The last encoding, shared: a scrape waits for the one encoding in progress (the lock), then
/// serves the last reply if it is younger than [`SHARE_FOR`] or twice the time it took to make,
/// else encodes anew. So however many clients scrape, encodings run one at a time, at most a
/// third of the time, and every reply in flight is one of few encodings, shared by reference
/// (`Bytes`), not a copy per client.
#[derive(Default)]
struct ScrapeCache {
    last: tokio::sync::Mutex<Option<Encoded>>,
    /// Encodings made (`ratelimit_metrics_encodings_total`).
    encodings: std::sync::atomic::AtomicU64,
}

/// One encoding's reply.
struct Encoded {
    done: std::time::Instant,
    took: Duration,
    body: axum::body::Bytes,
}

impl Encoded {
    fn fresh(&self) -> bool {
        self.done.elapsed() < SHARE_FOR.max(self.took * 2)
    }
}

/// Records and logs that `addr` is bound.
fn bound(
    health: &MetricsHandle,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
) -> tokio::net::TcpListener {
    let local = listener.local_addr().unwrap_or(addr);
    let mut failures = 0;
    health.update(|s| {
        s.state = "serving";
        s.error = None;
        failures = s.bind_failures;
    });
    tracing::info!(
        addr = %local,
        bind_failures = failures,
        "serving metrics at http://{local}/metrics"
    );
    listener
}

/// Records and logs a failed attempt to bind `addr`; the next is in `retry`.
fn bind_failed(health: &MetricsHandle, addr: SocketAddr, error: &str, retry: Duration) {
    let mut failures = 0;
    health.update(|s| {
        s.bind_failures += 1;
        s.error = Some(error.to_string());
        failures = s.bind_failures;
    });
    tracing::error!(
        addr = %addr,
        error = %error,
        failures,
        retry_in_ms = u64::try_from(retry.as_millis()).unwrap_or(u64::MAX),
        "metrics endpoint NOT serving: {error}; the limiter enforces without it, binding again \
         in {} s",
        retry.as_secs()
    );
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        format!("metrics endpoint: cannot listen on {addr} (`metrics` in [agent]): {e}")
    })
}

async fn scrape(axum::extract::State(state): axum::extract::State<ScrapeState>) -> Response {
    let ok =
        |body: axum::body::Bytes| ([(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response();
    // One encoding at a time: the others wait here, then share its reply.
    let mut last = state.cache.last.lock().await;
    if let Some(e) = last.as_ref().filter(|e| e.fresh()) {
        return ok(e.body.clone());
    }
    let began = std::time::Instant::now();
    let census = state.read.census.fresh().await;
    let partial = Snapshot::of_agent(&*state.agent.lock().await);
    let encodings = state
        .cache
        .encodings
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        + 1;
    // The map reads are system calls (a few per rule): on a blocking thread, off the lock.
    let read = state.read.clone();
    let cluster = state.cluster.clone();
    let result = tokio::task::spawn_blocking(move || {
        let stats = read.stats(&census)?;
        let mut s = Snapshot {
            stats,
            cluster: cluster.as_ref().map(ClusterHandle::status),
            encodings,
            ..partial
        };
        s.read_interface_counters(Path::new("/sys/class/net"));
        Ok::<_, crate::maps::MapsError>(s.encode())
    })
    .await;
    match result {
        Ok(Ok(Ok(text))) => {
            let body = axum::body::Bytes::from(text);
            *last = Some(Encoded {
                done: std::time::Instant::now(),
                took: began.elapsed(),
                body: body.clone(),
            });
            ok(body)
        }
        Ok(Ok(Err(e))) => error_response(&format!("encoding the metrics: {e}")),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "metrics scrape: reading the counters failed");
            error_response(&format!("reading the counters: {e}"))
        }
        Err(e) => error_response(&format!("metrics scrape task failed: {e}")),
    }
}

fn error_response(message: &str) -> Response {
    (StatusCode::INTERNAL_SERVER_ERROR, format!("{message}\n")).into_response()
}

/// Everything one scrape reports, read from the agent at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// Agent version (`ratelimit_build_info`).
    pub version: String,
    /// Counters and bucket occupancy from the pinned maps.
    pub stats: StatsReport,
    /// Rule-set changes applied.
    pub reloads_ok: u64,
    /// Rule-set changes refused.
    pub reloads_failed: u64,
    /// Attached interfaces.
    pub interfaces: Vec<InterfaceSnapshot>,
    /// Cluster sync counters and peer states, when the agent is in a cluster.
    pub cluster: Option<ClusterStatus>,
    /// Encodings of the endpoint so far, this one included (`ratelimit_metrics_encodings_total`).
    pub encodings: u64,
}

/// One attached interface.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InterfaceSnapshot {
    /// Interface name.
    pub name: String,
    /// Attach mode: native, skb or adopted.
    pub mode: String,
    /// The kernel's `rx_packets` for the interface, if readable.
    pub rx_packets: Option<u64>,
    /// The kernel's `rx_dropped` for the interface, if readable.
    pub rx_dropped: Option<u64>,
}

impl Snapshot {
    /// What the agent itself holds: its version, reload counts and attachments (copies, no
    /// system call; taken under the lock). The counters and the cluster's status are added off
    /// the lock.
    #[must_use]
    pub fn of_agent(agent: &Agent) -> Self {
        let reload = agent.reload_state();
        Self {
            version: env!("CARGO_PKG_VERSION").to_string(),
            reloads_ok: reload.ok,
            reloads_failed: reload.failed,
            interfaces: agent
                .dataplane()
                .attachments()
                .iter()
                .map(|a| InterfaceSnapshot {
                    name: a.iface.clone(),
                    mode: a.mode.to_string(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    /// Fills in each interface's kernel counters from `sys_class_net/IF/statistics/`; an
    /// unreadable counter (the interface just went away) is left out of the scrape.
    pub fn read_interface_counters(&mut self, sys_class_net: &Path) {
        for i in &mut self.interfaces {
            let read = |name: &str| {
                std::fs::read_to_string(sys_class_net.join(&i.name).join("statistics").join(name))
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
            };
            i.rx_packets = read("rx_packets");
            i.rx_dropped = read("rx_dropped");
        }
    }

    /// The snapshot in the OpenMetrics text format.
    pub fn encode(self) -> Result<String, fmt::Error> {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(self));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry)?;
        Ok(out)
    }
}

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

/// The cluster sync's metrics (`ratelimit_cluster_*`).
fn encode_cluster(enc: &mut DescriptorEncoder, cluster: &ClusterStatus) -> Result<(), fmt::Error> {
    let c = &cluster.counters;
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
         old, from the future, replayed), malformed, unsafe (authentic, but what would crash or \
         corrupt the gossip library: see cluster::inspect).",
        [
            ("auth", c.rejected_auth),
            ("stale", c.rejected_stale),
            ("malformed", c.rejected_malformed),
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
    )?;
    let mut states: std::collections::BTreeMap<&str, i64> = ["alive", "joining", "silent", "dead"]
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
    )?;
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
    )?;
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
    )?;
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
    )?;
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
    )?;
    encode_key_shares(enc, cluster)
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
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), fmt::Error> {
        let s = &self.stats;
        let per_rule = |pick: fn(
            &crate::stats::RuleReport,
        ) -> &std::collections::BTreeMap<&'static str, u64>| {
            s.rules.iter().flat_map(move |r| {
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
            &mut enc,
            "ratelimit_rule_packets",
            "Packets that matched each rule, by verdict: passed (within the limit), allowed (allow \
             rule), dropped_rate, dropped_bytes, denied (deny rule), dry_run (would have been dropped; \
             passed), no_bucket (no bucket could be created; passed). The XDP program counts per \
             rule, not per interface.",
            per_rule(|r| &r.packets),
        )?;
        family(
            &mut enc,
            "ratelimit_rule_bytes",
            "Bytes (whole frames, Ethernet header included) that matched each rule, by verdict (see ratelimit_rule_packets).",
            per_rule(|r| &r.bytes),
        )?;

        let limit_names: Vec<(
            String,
            &crate::stats::RuleReport,
            &crate::stats::LimitReport,
        )> = s
            .rules
            .iter()
            .flat_map(|r| r.limits.iter().map(move |l| (l.limit.to_string(), r, l)))
            .collect();
        family(
            &mut enc,
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
        )?;

        let g = |i: usize| s.global.get(global::NAMES[i]).copied().unwrap_or(0);
        let (packets, name, help) = GLOBAL_COUNTERS[0];
        single(&mut enc, name, help, &ConstCounter::new(g(packets)))?;
        family(
            &mut enc,
            "ratelimit_parse_failures",
            "Frames the XDP program could not parse, by reason: passed unclassified (truncated_l4: \
             classified without ports).",
            PARSE_FAILURES.iter().map(|&i| (vec![("reason", global::NAMES[i])], ConstCounter::new(g(i)))),
        )?;
        for &(i, name, help) in &GLOBAL_COUNTERS[1..] {
            single(&mut enc, name, help, &ConstCounter::new(g(i)))?;
        }
        family(
            &mut enc,
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
            &mut enc,
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
        )?;

        single(
            &mut enc,
            "ratelimit_buckets_tracked",
            "Token buckets (source, rule) currently tracked.",
            &ConstGauge::new(s.buckets.tracked),
        )?;
        single(
            &mut enc,
            "ratelimit_buckets_capacity",
            "Capacity of the bucket store (max_buckets, rounded up to a multiple of 64: whole pages of sets); a new source \
             takes the record of an empty, stale or refilled bucket among its 8 candidates, else \
             of the one least in debt (see ratelimit_bucket_evictions).",
            &ConstGauge::new(s.buckets.capacity),
        )?;
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
        single(
            &mut enc,
            "ratelimit_metrics_encodings",
            "Encodings of this endpoint's reply, this one included: one at a time, each reply \
             shared by the scrapes of the next second (or twice the encoding's time).",
            &ConstCounter::new(self.encodings),
        )?;
        let info = Info::new(vec![("version", self.version.as_str())]);
        single(
            &mut enc,
            "ratelimit_build",
            "Agent build information.",
            &info,
        )?;

        family(
            &mut enc,
            "ratelimit_interface_attached",
            "Interfaces the XDP program is attached to, with the attach mode (native, skb, or \
             adopted from a previous agent).",
            self.interfaces.iter().map(|i| {
                let labels: Labels =
                    vec![("interface", i.name.as_str()), ("mode", i.mode.as_str())];
                (labels, ConstGauge::new(1_i64))
            }),
        )?;
        let kernel_note =
            "as the kernel reports it in /sys/class/net/IF/statistics (whether packets \
                           the XDP program dropped are included depends on the driver). The XDP \
                           program's own counters are per rule, not per interface: counting per \
                           interface in the fast path would cost a map lookup per packet.";
        let iface_counter = |pick: fn(&InterfaceSnapshot) -> Option<u64>| {
            self.interfaces.iter().filter_map(move |i| {
                pick(i).map(|n| (vec![("interface", i.name.as_str())], ConstCounter::new(n)))
            })
        };
        family(
            &mut enc,
            "ratelimit_interface_rx_packets",
            &format!("Packets received on each attached interface, {kernel_note}"),
            iface_counter(|i| i.rx_packets),
        )?;
        family(
            &mut enc,
            "ratelimit_interface_rx_dropped",
            &format!("Received packets dropped on each attached interface, {kernel_note}"),
            iface_counter(|i| i.rx_dropped),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::stats::{BucketReport, RuleReport};

    fn snapshot() -> Snapshot {
        let mut packets: BTreeMap<&'static str, u64> =
            verdict::NAMES.iter().map(|v| (*v, 0)).collect();
        packets.insert("passed", 100);
        packets.insert("dropped_rate", 200);
        let mut bytes: BTreeMap<&'static str, u64> =
            verdict::NAMES.iter().map(|v| (*v, 0)).collect();
        bytes.insert("passed", 10_600);
        let global = global::NAMES
            .iter()
            .enumerate()
            .filter(|(_, n)| !n.is_empty())
            .map(|(i, n)| (*n, i as u64 * 10))
            .collect();
        Snapshot {
            version: "1.2.3".into(),
            encodings: 4,
            stats: StatsReport {
                global,
                rules: vec![RuleReport {
                    id: 3,
                    name: "web \"edge\"".into(),
                    line: 7,
                    packets,
                    bytes,
                    limits: vec![
                        crate::stats::LimitReport {
                            limit: 1,
                            per: "source".into(),
                            dropped_rate: 150,
                            dropped_bytes: 0,
                        },
                        crate::stats::LimitReport {
                            limit: 2,
                            per: "/24".into(),
                            dropped_rate: 50,
                            dropped_bytes: 0,
                        },
                    ],
                }],
                buckets: BucketReport {
                    tracked: 5,
                    capacity: 4096,
                },
            },
            reloads_ok: 2,
            reloads_failed: 1,
            interfaces: vec![
                InterfaceSnapshot {
                    name: "eth0".into(),
                    mode: "native".into(),
                    rx_packets: Some(42),
                    rx_dropped: Some(0),
                },
                InterfaceSnapshot {
                    name: "gone".into(),
                    mode: "skb".into(),
                    rx_packets: None,
                    rx_dropped: None,
                },
            ],
            cluster: Some(crate::cluster::ClusterStatus {
                peers: vec![crate::cluster::PeerStatus {
                    stored_keys: 3,
                    node_id: "b".into(),
                    generation: 1,
                    addr: "192.0.2.2:7946".parse().unwrap(),
                    state: "alive",
                    counted: true,
                    last_heard_ms: Some(10),
                    lag_ms: Some(120),
                    keys: 3,
                    charged_pkts: 7,
                    charged_bytes: 700,
                    clamped: 0,
                }],
                counters: crate::cluster::CounterValues {
                    rejected_auth: 4,
                    messages_in: 9,
                    sync_lag_ms: 250,
                    share_charged_pkts: 66,
                    ..Default::default()
                },
                on_partition: "share",
                hosts_heard: 1,
                hosts_known: 3,
                budget_share: 0.5,
                ..Default::default()
            }),
        }
    }

    #[test]
    fn encodes_the_documented_names() {
        let text = snapshot().encode().unwrap();
        for line in [
            r#"ratelimit_rule_packets_total{rule="web \"edge\"",verdict="passed"} 100"#,
            r#"ratelimit_limit_dropped_packets_total{rule="web \"edge\"",limit="1",verdict="dropped_rate"} 150"#,
            r#"ratelimit_limit_dropped_packets_total{rule="web \"edge\"",limit="2",verdict="dropped_rate"} 50"#,
            r#"ratelimit_limit_dropped_packets_total{rule="web \"edge\"",limit="2",verdict="dropped_bytes"} 0"#,
            r#"ratelimit_rule_packets_total{rule="web \"edge\"",verdict="dropped_rate"} 200"#,
            r#"ratelimit_rule_packets_total{rule="web \"edge\"",verdict="no_bucket"} 0"#,
            r#"ratelimit_rule_bytes_total{rule="web \"edge\"",verdict="passed"} 10600"#,
            "ratelimit_packets_total 0",
            "ratelimit_non_ip_packets_total 10",
            r#"ratelimit_parse_failures_total{reason="truncated_eth"} 20"#,
            r#"ratelimit_parse_failures_total{reason="truncated_l4"} 70"#,
            "ratelimit_fragments_total 80",
            "ratelimit_unmatched_packets_total 90",
            "ratelimit_new_buckets_total 100",
            "ratelimit_bucket_errors_total 110",
            "ratelimit_internal_errors_total 120",
            r#"ratelimit_bucket_evictions_total{state="full"} 130"#,
            r#"ratelimit_bucket_evictions_total{state="lost"} 140"#,
            "ratelimit_fragments_unmatched_total 150",
            r#"ratelimit_shape_drops_total{reason="tiny_fragment"} 160"#,
            r#"ratelimit_shape_drops_total{reason="long_header_chain"} 170"#,
            r#"ratelimit_shape_drops_total{reason="fragment_conflict"} 180"#,
            r#"ratelimit_shape_drops_total{reason="vlan_chain"} 210"#,
            r#"ratelimit_shape_drops_total{reason="unmatched_fragment"} 220"#,
            "ratelimit_long_header_chains_total 190",
            "ratelimit_buckets_tracked 5",
            "ratelimit_buckets_capacity 4096",
            r#"ratelimit_reloads_total{result="ok"} 2"#,
            r#"ratelimit_reloads_total{result="failed"} 1"#,
            r#"ratelimit_build_info{version="1.2.3"} 1"#,
            r#"ratelimit_interface_attached{interface="eth0",mode="native"} 1"#,
            r#"ratelimit_interface_attached{interface="gone",mode="skb"} 1"#,
            r#"ratelimit_interface_rx_packets_total{interface="eth0"} 42"#,
            r#"ratelimit_interface_rx_dropped_total{interface="eth0"} 0"#,
            r#"ratelimit_cluster_messages_total{direction="in"} 9"#,
            r#"ratelimit_cluster_rejected_total{reason="auth"} 4"#,
            r#"ratelimit_cluster_peers{state="alive"} 1"#,
            r#"ratelimit_cluster_peers{state="dead"} 0"#,
            "ratelimit_cluster_sync_lag_seconds 0.25",
            r#"ratelimit_cluster_hosts{view="heard"} 1"#,
            r#"ratelimit_cluster_hosts{view="known"} 3"#,
            "ratelimit_cluster_budget_share 0.5",
            "ratelimit_cluster_share_charged_packets_total 66",
            "# TYPE ratelimit_rule_packets counter",
            "# TYPE ratelimit_buckets_tracked gauge",
            "# TYPE ratelimit_build info",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in:\n{text}"
            );
        }
        assert!(
            !text.contains(r#"interface="gone"} "#),
            "unreadable counters are left out:\n{text}"
        );
        assert_eq!(
            text.matches("ratelimit_rule_packets_total{").count(),
            verdict::COUNT
        );
    }

    /// The heaviest keys' gauges: hosts per key, and per holder (this host and each peer with
    /// demand, by node id) its demand and share; no key, no sample.
    #[test]
    fn cluster_key_gauges_name_each_holder() {
        let holder = |node: &str, demand_pps: f64, share: f64| crate::cluster::HolderStatus {
            node_id: node.into(),
            generation: 1,
            demand_pps,
            share,
        };
        let text = snapshot().encode().unwrap();
        assert!(!text.contains("ratelimit_cluster_key_"), "{text}");
        let mut s = snapshot();
        s.cluster.as_mut().unwrap().keys = vec![crate::cluster::KeyStatus {
            rule: "flood".into(),
            limit: 1,
            key: "198.18.0.7/32".into(),
            hosts: 3,
            demand_pps: 2000.0,
            holders: vec![
                holder("a/192.0.2.1:7946", 500.0, 0.25),
                holder("b/192.0.2.2:7946", 1500.0, 0.75),
            ],
            idle_holders: 1,
            idle_share: 0.0,
        }];
        let text = s.encode().unwrap();
        for line in [
            r#"ratelimit_cluster_key_hosts{rule="flood",limit="1",key="198.18.0.7/32"} 3"#,
            r#"ratelimit_cluster_key_demand_pps{rule="flood",limit="1",key="198.18.0.7/32",holder="a/192.0.2.1:7946"} 500.0"#,
            r#"ratelimit_cluster_key_demand_pps{rule="flood",limit="1",key="198.18.0.7/32",holder="b/192.0.2.2:7946"} 1500.0"#,
            r#"ratelimit_cluster_key_share{rule="flood",limit="1",key="198.18.0.7/32",holder="a/192.0.2.1:7946"} 0.25"#,
            r#"ratelimit_cluster_key_share{rule="flood",limit="1",key="198.18.0.7/32",holder="b/192.0.2.2:7946"} 0.75"#,
            "# TYPE ratelimit_cluster_key_share gauge",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in:\n{text}"
            );
        }
        assert_eq!(text.matches("ratelimit_cluster_key_share{").count(), 2);
    }

    #[test]
    fn empty_families_are_left_out() {
        let text = Snapshot::default().encode().unwrap();
        assert!(!text.contains("ratelimit_rule_packets"), "{text}");
        assert!(!text.contains("ratelimit_interface_attached"), "{text}");
        assert!(text.contains("ratelimit_buckets_tracked 0"), "{text}");
        assert!(
            text.contains(r#"ratelimit_reloads_total{result="failed"} 0"#),
            "{text}"
        );
    }

    #[test]
    fn interface_counters_from_sysfs() {
        let dir = std::env::temp_dir().join(format!("rl-metrics-sysfs-{}", std::process::id()));
        let stats = dir.join("eth0").join("statistics");
        std::fs::create_dir_all(&stats).unwrap();
        std::fs::write(stats.join("rx_packets"), "1234\n").unwrap();
        std::fs::write(stats.join("rx_dropped"), "5\n").unwrap();
        let mut s = snapshot();
        s.read_interface_counters(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            (s.interfaces[0].rx_packets, s.interfaces[0].rx_dropped),
            (Some(1234), Some(5))
        );
        assert_eq!(
            (s.interfaces[1].rx_packets, s.interfaces[1].rx_dropped),
            (None, None)
        );
    }

    #[tokio::test]
    async fn bind_failure_names_the_address() {
        let taken = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = taken.local_addr().unwrap();
        let err = bind(addr).await.unwrap_err().to_string();
        assert!(err.contains(&addr.to_string()), "{err}");
        assert!(err.contains("in use"), "{err}");
    }
}
