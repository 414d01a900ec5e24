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
//! | `ratelimit_non_ip_packets_total`, `ratelimit_fragments_total`, `ratelimit_unmatched_packets_total`, `ratelimit_new_buckets_total`, `ratelimit_first_packets_total`, `ratelimit_bucket_errors_total`, `ratelimit_internal_errors_total` | counter | |
//! | `ratelimit_buckets_tracked`, `ratelimit_buckets_capacity` | gauge | |
//! | `ratelimit_bucket_evictions_total` | counter | `state` (`full`, `lost`) |
//! | `ratelimit_shape_drops_total` | counter | `reason` (`tiny_fragment`, `long_header_chain`, `fragment_conflict`, `vlan_chain`, `unmatched_fragment`) |
//! | `ratelimit_fragments_unmatched_total`, `ratelimit_long_header_chains_total` | counter | |
//! | `ratelimit_reloads_total` | counter | `result` (`ok`, `failed`) |
//! | `ratelimit_metrics_encodings_total` | counter | |
//! | `ratelimit_build_info` | info | `version` |
//! | `ratelimit_interface_attached` | gauge | `interface`, `mode` |
//! | `ratelimit_interface_rx_packets_total`, `ratelimit_interface_rx_dropped_total` | counter | `interface` |
//! | `ratelimit_learned_peak_rate` | gauge | `rule`, `limit`, `window` (`1s`, `10s`), `quantile` (`0.5`, `0.9`, `0.99`) |
//! | `ratelimit_learned_burst` | gauge | `rule`, `limit`, `quantile` |
//! | `ratelimit_learned_sources` | gauge | `rule`, `limit` |

use std::{fmt, net::SocketAddr, path::Path, sync::Arc, time::Duration};

use serde::Serialize;

use axum::{
    http::{header, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use prometheus_client::registry::Registry;
use ratelimit_common::global;

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
const GLOBAL_COUNTERS: [(usize, &str, &str); 11] = [
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
        global::FIRST_PACKETS,
        "ratelimit_first_packets",
        "Packets of sources without a bucket whose bucket would have been full: passed without making one \
         (the source's next packet before it would be full again makes it, owing this one).",
    ),
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
    learn: Option<crate::learn::LearnHandle>,
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
            learn,
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
    learn: Option<crate::learn::LearnHandle>,
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
    let learn = state.learn.clone();
    let result = tokio::task::spawn_blocking(move || {
        let stats = read.stats(&census)?;
        let mut s = Snapshot {
            stats,
            cluster: cluster.as_ref().map(ClusterHandle::status),
            learned: learn.map(|l| l.gauges()).unwrap_or_default(),
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
    /// What `suggest` learned, per rule and limit, over the last hour.
    pub learned: Vec<crate::learn::Gauges>,
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

mod encode;

#[cfg(test)]
mod tests;
