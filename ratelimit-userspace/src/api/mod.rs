//! The control API: HTTP/1.1 with JSON bodies on a root-only Unix socket, served to the
//! `ratelimit` CLI (see [`crate::client`]) and to `curl --unix-socket SOCKET http://agent/v1/...`.
//!
//! Every change is validated whole before anything in force changes; a refused request gets a
//! 4xx status and `{"error": "..."}` naming the field at fault. The JSON shapes below are part of
//! the user-facing contract: fields may be added, none renamed or removed.
//!
//! # Routes
//! | route | answer |
//! | --- | --- |
//! | `GET /v1/status` | `{"version", "pid", "uptime_secs", "config", "pin_path", "socket", "interfaces": [{"iface", "mode", "state"}], "rules", "prefixes", "generation", "dry_run", "buckets_tracked", "buckets_census": {"age_ms", "walk_us"}, "buckets_capacity", "buckets_evicted": {"full", "lost"}, "reloads": {"ok", "failed", "last_error", "last_ok_unix", "restart_needed"}, "metrics": null or {"listen", "state" ("serving" or "unbound"), "error", "bind_failures"}, "cluster": null or the cluster's status}` |
//! | `GET /v1/rules` | `{"rules": [RULE, ...]}` in config order |
//! | `POST /v1/rules[?force=true]` | body: one RULE; `201 {"added": RULE, "rules": N}`; `409` when the file's rules are not those in force, unless `force` |
//! | `DELETE /v1/rules/{name}[?force=true]` | `{"removed": "name", "rules": N}`; `409` as above |
//! | `POST /v1/reload` | re-reads the config file: `{"reloaded": true, "rules": N, "restart_needed": [..]}` |
//! | `GET /v1/stats` | the `ratelimit stats --json` report (see [`crate::stats`]) |
//! | `GET /v1/top?n=N&interval_ms=M[&limit=L]` | `{"interval_ms", "buckets_tracked", "active", "windows", "top": [TOP, ...]}` |
//! | `GET /v1/explain?ip=IP&protocol=P&dst_port=N&tcp_flags=F` | `{"ip", "protocol", "dst_port", "tcp_flags", "rule": {"name", "id", "line", "config": RULE} or null, "prefix", "candidates", "why", "bucket": BUCKET or null, "cut": {"verdict": "dropped"/"passed"/"rule", "rule", "why"}}` |
//! | `POST /v1/detach` | optional body `{"iface": "eth0"}`; `{"detached": ["eth0"]}` |
//!
//! RULE is a rule with the config file's keys: `{"name", "source": "CIDR" or ["CIDR", ..],
//! "action", "rate", "burst", "bytes_rate", "bytes_burst", "per", "protocol", "dst_port", "tcp_flags", "scope",
//! "dry_run", "limit": [LIMIT, ..]}`; keys meaningless for the rule's action are left out. A sent
//! rule goes through the config file's parser (written as one `[[rule]]` table): the same
//! defaults, ranges and messages (`burst` defaults to `rate`, `protocol` to `any`...).
//!
//! TOP is one bucket's use over the interval: `{"rule", "rule_id", "source" (the bucket's
//! address masked to the rule's `per`, e.g. `"198.18.1.0/24"`, or `"*"` for a `per = "rule"`
//! limit's one bucket), "pps" (packets passed per
//! second), "drops_per_sec", "tokens" (packet tokens left now, negative in debt, null without a
//! packet limit), "byte_tokens", "passed", "dropped" (totals since the bucket was created)}`,
//! sorted by `pps + drops_per_sec`, highest first; buckets that saw no packet in the interval are
//! left out. `n` defaults to 10, `interval_ms` to 1000 (10..=60000). `top` keeps at most 16 MiB
//! however many buckets are tracked: beyond a million it measures the store in successive
//! windows of `interval_ms` each (`windows`; see `api/top.rs`). One `top` runs at a time.
//!
//! `buckets_tracked` (in `status` and `stats`) comes from the bucket census, a paced walk of the
//! store off the agent's lock: exact when the store is small enough to walk within 30 ms of the
//! question, else the latest count, `buckets_census.age_ms` old.
//!
//! BUCKET is `{"tokens", "byte_tokens", "passed", "dropped", "age_secs"}`. In `explain`,
//! `protocol` is `tcp`, `udp`, `icmp` or a protocol number (answered as the number, 0 for none);
//! `tcp_flags` (protocol tcp only) the flags the packet carries, e.g. `syn`, `syn,ack`, `ack`
//! (answered as the flags byte; null when not given, which explains a packet with no flag set).
//!
//! A rule read from a list file shows `"source_file": "PATH"` instead of `source`; list files can
//! only be named in the config file, not sent.
//!
//! Errors: 400 malformed or invalid request, 404 unknown route or rule, 409 a rule of that name
//! exists or the rule set would not compile, 422 the config file is invalid (reload), 500 the data
//! plane failed. Body `{"error": "message"}`.
//!
//! The socket takes at most 64 connections (the oldest idle one is closed for a new one), and a
//! request's headers and body must each arrive within 10 s ([`crate::http`]).
//!
//! ```text
//! curl --unix-socket /run/ratelimit/agent.sock http://agent/v1/status
//! curl --unix-socket /run/ratelimit/agent.sock http://agent/v1/rules \
//!      -d '{"name": "dns", "source": "::/0", "protocol": "udp", "dst_port": 53, "rate": 100}'
//! curl --unix-socket /run/ratelimit/agent.sock -X DELETE http://agent/v1/rules/dns
//! curl --unix-socket /run/ratelimit/agent.sock 'http://agent/v1/top?n=5&interval_ms=500'
//! ```

#[cfg(any(test, feature = "probe"))]
pub mod probe;
mod top;

use std::{
    fs,
    future::Future,
    io::ErrorKind,
    net::IpAddr,
    os::unix::fs::{DirBuilderExt as _, FileTypeExt as _, PermissionsExt as _},
    path::Path,
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use axum::{
    body::Bytes,
    extract::{
        rejection::{PathRejection, QueryRejection},
        Path as UrlPath, Query, State,
    },
    http::{Method, StatusCode, Uri},
    response::{IntoResponse, Response},
    routing::{delete, get, post},
    Json, Router,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

pub use self::top::{top_entries, TopBaseline, TopEntry, TopRanker, TopReport, BASELINE_BUDGET};

use crate::{
    agent::{AgentError, SharedAgent, Status},
    census::ReadSide,
    cluster::{ClusterHandle, ClusterStatus},
    config::{Protocol, RuleConfig},
    metrics::{EndpointStatus, MetricsHandle},
};

/// Default and bounds of `top`'s `interval_ms`.
pub const TOP_INTERVAL_MS: (u64, u64, u64) = (1000, 10, 60_000);
/// Default and largest `top` `n`.
pub const TOP_N: (usize, usize) = (10, 100_000);

/// What the API serves: the agent, what is read without its lock, and the cluster sync's handle
/// when the agent is in a cluster.
#[derive(Clone)]
pub struct ApiState {
    /// The agent.
    pub agent: SharedAgent,
    /// The pinned maps, the bucket census and the rules in force, read without the agent's lock
    /// (`status`'s bucket count, `stats`, `top`).
    pub read: ReadSide,
    /// The cluster sync (`None` without `[cluster]`).
    pub cluster: Option<ClusterHandle>,
    /// The metrics endpoint's health (`None` without `[agent] metrics`).
    pub metrics: Option<MetricsHandle>,
    /// One `top` at a time.
    pub top_turn: Arc<Semaphore>,
}

impl ApiState {
    /// The state for `agent`, `read` and `cluster`.
    #[must_use]
    pub fn new(agent: SharedAgent, read: ReadSide, cluster: Option<ClusterHandle>) -> Self {
        Self {
            agent,
            read,
            cluster,
            metrics: None,
            top_turn: Arc::new(Semaphore::new(1)),
        }
    }

    /// With the metrics endpoint's health, for `status`.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Option<MetricsHandle>) -> Self {
        self.metrics = metrics;
        self
    }
}

/// Serves the API on `listener` (from [`bind`]) until the task is aborted.
/// Connections are capped and slow clients timed out ([`crate::http`]).
pub fn serve(listener: tokio::net::UnixListener, state: ApiState) -> tokio::task::JoinHandle<()> {
    tokio::spawn(crate::http::serve(
        listener,
        router(state),
        crate::http::Limits {
            takes_body,
            ..crate::http::Limits::default()
        },
        "control API",
    ))
}

/// Creates the socket's directory (0755) if missing, removes a stale socket left by a dead agent,
/// refuses to start if a live agent answers on it, binds, and makes the socket root-only (0600).
/// The agent binds before it loads anything, so a second agent started by mistake stops before
/// touching the first one's interfaces and pinned state.
pub fn bind(socket: &Path) -> Result<tokio::net::UnixListener, AgentError> {
    let err = |what: &str, e: std::io::Error| {
        AgentError::Runtime(format!("control socket {}: {what}: {e}", socket.display()))
    };
    if let Some(dir) = socket.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(|e| err(&format!("creating {}", dir.display()), e))?;
        }
    }
    match fs::symlink_metadata(socket) {
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(err("inspecting", e)),
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(AgentError::Runtime(format!(
                "control socket {} exists and is not a socket: remove it or set another `socket` in [agent]",
                socket.display()
            )));
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(socket) {
            Ok(_) => {
                return Err(AgentError::Runtime(format!(
                    "another agent is running on {}: stop it first (`ratelimit --socket {0} status` shows it), \
                     or give this one another `socket` in [agent]",
                    socket.display()
                )));
            }
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                tracing::info!(socket = %socket.display(), "removing a stale control socket");
                fs::remove_file(socket).map_err(|e| err("removing the stale socket", e))?;
            }
            Err(e) => return Err(err("checking for a running agent", e)),
        },
    }
    // The umask keeps the socket private from the moment it exists (chmod after bind would leave
    // a window in which anyone could connect); nothing else creates files while the agent starts.
    // SAFETY: umask has no preconditions.
    let old = unsafe { libc::umask(0o177) };
    let bound = tokio::net::UnixListener::bind(socket);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let listener = bound.map_err(|e| err("binding", e))?;
    fs::set_permissions(socket, fs::Permissions::from_mode(0o600))
        .map_err(|e| err("setting permissions 0600", e))?;
    Ok(listener)
}

/// Whether the API request `method` `path` takes a body: only `POST /v1/rules` (the rule) and
/// `POST /v1/detach` (the interface) do; a body on any other request is refused unread.
#[must_use]
pub fn takes_body(method: &Method, path: &str) -> bool {
    method == Method::POST && matches!(path, "/v1/rules" | "/v1/detach")
}

/// The API's routes over `backend`: [`ApiState`] in the agent, [`probe::Recorder`] in tests and
/// the fuzzer. Every request is parsed and validated here, in the handlers; the backend is only
/// called with what passed.
pub fn router<B: Backend>(backend: B) -> Router {
    Router::new()
        .route("/v1/status", get(status::<B>))
        .route("/v1/rules", get(rules_list::<B>).post(rules_add::<B>))
        .route("/v1/rules/{name}", delete(rules_remove::<B>))
        .route("/v1/reload", post(reload::<B>))
        .route("/v1/stats", get(stats::<B>))
        .route("/v1/top", get(top::<B>))
        .route("/v1/explain", get(explain::<B>))
        .route("/v1/detach", post(detach::<B>))
        .route("/v1/cluster", get(cluster::<B>))
        .fallback(no_route)
        .method_not_allowed_fallback(no_method)
        .with_state(backend)
}

/// What the API's handlers do once a request is parsed and validated: one method per operation,
/// each answering the JSON body of a success. [`ApiState`] does it on the agent; tests and the
/// fuzzer use [`probe::Recorder`], which records what it is asked.
pub trait Backend: Clone + Send + Sync + 'static {
    /// `GET /v1/status`.
    fn status(&self) -> impl Future<Output = Result<Value, ApiError>> + Send;
    /// `GET /v1/rules`.
    fn rules(&self) -> impl Future<Output = Result<Value, ApiError>> + Send;
    /// `POST /v1/rules`: `rule` is valid ([`rule_from_json`] accepted it).
    fn add_rule(
        &self,
        rule: RuleConfig,
        force: bool,
    ) -> impl Future<Output = Result<Value, ApiError>> + Send;
    /// `DELETE /v1/rules/{name}`.
    fn remove_rule(
        &self,
        name: String,
        force: bool,
    ) -> impl Future<Output = Result<Value, ApiError>> + Send;
    /// `POST /v1/reload`.
    fn reload(&self) -> impl Future<Output = Result<Value, ApiError>> + Send;
    /// `GET /v1/stats`.
    fn stats(&self) -> impl Future<Output = Result<Value, ApiError>> + Send;
    /// `GET /v1/cluster`.
    fn cluster(&self) -> impl Future<Output = Result<Value, ApiError>> + Send;
    /// `GET /v1/top`: `n` in 1..=[`TOP_N`]`.1`, `interval` within [`TOP_INTERVAL_MS`], `limit`
    /// in 1..=[`ratelimit_common::MAX_LIMITS`].
    fn top(
        &self,
        n: usize,
        interval: Duration,
        limit: Option<usize>,
    ) -> impl Future<Output = Result<Value, ApiError>> + Send;
    /// `GET /v1/explain`, as [`explain_args`] and [`explain_tcp_flags`] parsed it.
    fn explain(
        &self,
        ip: IpAddr,
        protocol: u8,
        dst_port: Option<u16>,
        tcp_flags: Option<u8>,
    ) -> impl Future<Output = Result<Value, ApiError>> + Send;
    /// `POST /v1/detach`: one interface, or all.
    fn detach(&self, iface: Option<String>)
        -> impl Future<Output = Result<Value, ApiError>> + Send;
}

impl Backend for ApiState {
    async fn status(&self) -> Result<Value, ApiError> {
        // The bucket count first, without the lock: the lock is then held for a few system calls.
        let census = self.read.census.fresh().await;
        let agent = self.agent.lock().await.status(&census)?;
        to_json(&StatusAnswer {
            agent,
            metrics: self.metrics.as_ref().map(MetricsHandle::status),
            cluster: self.cluster.as_ref().map(ClusterHandle::status),
        })
    }

    async fn rules(&self) -> Result<Value, ApiError> {
        let guard = self.agent.lock().await;
        to_json(&json!({ "rules": guard.config().rules }))
    }

    async fn add_rule(&self, rule: RuleConfig, force: bool) -> Result<Value, ApiError> {
        let mut guard = self.agent.lock().await;
        tokio::task::block_in_place(|| guard.add_rule(rule.clone(), force))?;
        let added = guard
            .config()
            .rules
            .iter()
            .find(|r| r.name == rule.name)
            .unwrap_or(&rule);
        tracing::info!(rule = %rule.name, "rule added (API)");
        Ok(json!({ "added": added, "rules": guard.config().rules.len() }))
    }

    async fn remove_rule(&self, name: String, force: bool) -> Result<Value, ApiError> {
        let mut guard = self.agent.lock().await;
        tokio::task::block_in_place(|| guard.remove_rule(&name, force))?;
        tracing::info!(rule = %name, "rule removed (API)");
        Ok(json!({ "removed": name, "rules": guard.config().rules.len() }))
    }

    async fn reload(&self) -> Result<Value, ApiError> {
        let mut guard = self.agent.lock().await;
        // These read the config file (and its lists): off the runtime's worker threads.
        tokio::task::block_in_place(|| guard.reload())?;
        Ok(json!({
            "reloaded": true,
            "rules": guard.config().rules.len(),
            "restart_needed": guard.reload_state().restart_needed,
        }))
    }

    async fn stats(&self) -> Result<Value, ApiError> {
        let census = self.read.census.fresh().await;
        let read = self.read.clone();
        let report = tokio::task::spawn_blocking(move || read.stats(&census))
            .await
            .map_err(|e| AgentError::Runtime(format!("stats: {e}")))?
            .map_err(AgentError::from)?;
        let mut value = serde_json::to_value(&report).map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: e.to_string(),
        })?;
        // The cluster sync's counters, when this agent is in a cluster.
        if let Some(cluster) = &self.cluster {
            value["cluster"] = json!(cluster.status().counters);
        }
        Ok(value)
    }

    async fn cluster(&self) -> Result<Value, ApiError> {
        match &self.cluster {
            Some(cluster) => to_json(&cluster.status()),
            None => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: "this agent is not in a cluster: its config has no [cluster] table".into(),
            }),
        }
    }

    async fn top(
        &self,
        n: usize,
        interval: Duration,
        limit: Option<usize>,
    ) -> Result<Value, ApiError> {
        // Off the agent's lock, one `top` at a time (each keeps up to 16 MiB of baseline).
        let _turn = self
            .top_turn
            .acquire()
            .await
            .map_err(|e| AgentError::Runtime(format!("top: {e}")))?;
        let report = top::measure(
            self.read.maps.clone(),
            self.read.rules.clone(),
            (n, limit),
            interval,
            top::BASELINE_BUDGET,
        )
        .await
        .map_err(AgentError::from)?;
        to_json(&report)
    }

    async fn explain(
        &self,
        ip: IpAddr,
        protocol: u8,
        dst_port: Option<u16>,
        tcp_flags: Option<u8>,
    ) -> Result<Value, ApiError> {
        let answer = self
            .agent
            .lock()
            .await
            .explain(ip, protocol, dst_port, tcp_flags)?;
        to_json(&answer)
    }

    async fn detach(&self, iface: Option<String>) -> Result<Value, ApiError> {
        let done = self.agent.lock().await.detach(iface.as_deref())?;
        Ok(json!({ "detached": done }))
    }
}

/// A refused or failed request: its status and the message of `{"error": ...}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    /// The status the request is answered with.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The message of `{"error": ...}`.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<AgentError> for ApiError {
    fn from(e: AgentError) -> Self {
        let status = match &e {
            AgentError::NoSuchRule(_) => StatusCode::NOT_FOUND,
            AgentError::RuleExists(_)
            | AgentError::Compile { .. }
            | AgentError::FileChanged { .. } => StatusCode::CONFLICT,
            AgentError::Config(_) => StatusCode::UNPROCESSABLE_ENTITY,
            AgentError::BadRequest(_)
            | AgentError::NoSuchInterface { .. }
            | AgentError::NoInterfaces(_) => StatusCode::BAD_REQUEST,
            AgentError::Dataplane(_) | AgentError::Maps(_) | AgentError::Runtime(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        Self {
            status,
            message: e.to_string(),
        }
    }
}

/// A query string axum cannot read (a key given twice, say): 400 with the API's `{"error": ...}`
/// (axum's own rejection is plain text).
impl From<QueryRejection> for ApiError {
    fn from(e: QueryRejection) -> Self {
        Self {
            status: e.status(),
            message: e.body_text(),
        }
    }
}

/// A path axum cannot read (a rule name that is not UTF-8 once decoded): as above.
impl From<PathRejection> for ApiError {
    fn from(e: PathRejection) -> Self {
        Self {
            status: e.status(),
            message: e.body_text(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }
}

type ApiResult<T = Json<Value>> = Result<T, ApiError>;

fn to_json(v: &impl Serialize) -> Result<Value, ApiError> {
    serde_json::to_value(v).map_err(|e| ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: format!("encoding the answer: {e}"),
    })
}

async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "no route {method} {}: the routes are /v1/status, /v1/rules, /v1/rules/NAME, /v1/reload, /v1/stats, /v1/top, /v1/explain, /v1/detach",
            uri.path()
        ),
    }
}

async fn no_method(method: Method, uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{} does not take {method}", uri.path()),
    }
}

/// `status` as the API answers it: the agent's, and the cluster's when in one.
#[derive(Serialize)]
struct StatusAnswer {
    #[serde(flatten)]
    agent: Status,
    /// The metrics endpoint's health, when `[agent] metrics` is set: `serving`, or `unbound`
    /// (its address could not be bound; retried in the background) with the error.
    metrics: Option<EndpointStatus>,
    /// Cluster members and counters, when `[cluster]` is set.
    cluster: Option<ClusterStatus>,
}

async fn status<B: Backend>(State(b): State<B>) -> ApiResult {
    b.status().await.map(Json)
}

async fn rules_list<B: Backend>(State(b): State<B>) -> ApiResult {
    b.rules().await.map(Json)
}

/// Query of `POST /v1/rules` and `DELETE /v1/rules/{name}`.
#[derive(Deserialize)]
struct ChangeQuery {
    force: Option<String>,
}

impl ChangeQuery {
    fn force(&self) -> Result<bool, ApiError> {
        match self.force.as_deref() {
            None | Some("false" | "0") => Ok(false),
            Some("true" | "1" | "") => Ok(true),
            Some(other) => Err(ApiError::bad_request(format!(
                "force: expected true or false, got {other:?}"
            ))),
        }
    }
}

async fn rules_add<B: Backend>(
    State(b): State<B>,
    q: Result<Query<ChangeQuery>, QueryRejection>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let force = q?.force()?;
    let value: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not JSON: {e}")))?;
    let rule = rule_from_json(&value).map_err(ApiError::bad_request)?;
    let body = b.add_rule(rule, force).await?;
    Ok((StatusCode::CREATED, Json(body)))
}

async fn rules_remove<B: Backend>(
    State(b): State<B>,
    name: Result<UrlPath<String>, PathRejection>,
    q: Result<Query<ChangeQuery>, QueryRejection>,
) -> ApiResult {
    let UrlPath(name) = name?;
    let force = q?.force()?;
    b.remove_rule(name, force).await.map(Json)
}

async fn reload<B: Backend>(State(b): State<B>) -> ApiResult {
    b.reload().await.map(Json)
}

async fn stats<B: Backend>(State(b): State<B>) -> ApiResult {
    b.stats().await.map(Json)
}

async fn cluster<B: Backend>(State(b): State<B>) -> ApiResult {
    b.cluster().await.map(Json)
}

/// Query of `GET /v1/top`: strings, so that a bad value gets our message rather than a rejection.
#[derive(Deserialize)]
struct TopQuery {
    n: Option<String>,
    interval_ms: Option<String>,
    limit: Option<String>,
}

async fn top<B: Backend>(
    State(b): State<B>,
    q: Result<Query<TopQuery>, QueryRejection>,
) -> ApiResult {
    let Query(q) = q?;
    let n = match q.n.as_deref() {
        None => TOP_N.0,
        Some(s) => s
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=TOP_N.1).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "n: {s:?} is not a number between 1 and {}",
                    TOP_N.1
                ))
            })?,
    };
    let (default, min, max) = TOP_INTERVAL_MS;
    let interval_ms = match q.interval_ms.as_deref() {
        None => default,
        Some(s) => s
            .parse::<u64>()
            .ok()
            .filter(|v| (min..=max).contains(v))
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "interval_ms: {s:?} is not a number between {min} and {max}"
                ))
            })?,
    };
    let limit = match q.limit.as_deref() {
        None => None,
        Some(s) => Some(
            s.parse::<usize>()
                .ok()
                .filter(|l| (1..=ratelimit_common::MAX_LIMITS).contains(l))
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "limit: {s:?} is not a number between 1 and {} (1: a rule's own limit, \
                         2..: its [[rule.limit]]s)",
                        ratelimit_common::MAX_LIMITS
                    ))
                })?,
        ),
    };
    b.top(n, Duration::from_millis(interval_ms), limit)
        .await
        .map(Json)
}

/// Query of `GET /v1/explain`.
#[derive(Deserialize)]
struct ExplainQuery {
    ip: Option<String>,
    protocol: Option<String>,
    dst_port: Option<String>,
    tcp_flags: Option<String>,
}

async fn explain<B: Backend>(
    State(b): State<B>,
    q: Result<Query<ExplainQuery>, QueryRejection>,
) -> ApiResult {
    let Query(q) = q?;
    let (ip, protocol, dst_port) = explain_args(
        q.ip.as_deref(),
        q.protocol.as_deref(),
        q.dst_port.as_deref(),
    )
    .map_err(ApiError::bad_request)?;
    let tcp_flags = q
        .tcp_flags
        .as_deref()
        .map(|f| explain_tcp_flags(f, protocol))
        .transpose()
        .map_err(ApiError::bad_request)?;
    b.explain(ip, protocol, dst_port, tcp_flags).await.map(Json)
}

/// Parses `explain`'s `tcp_flags`: the flags the packet carries, as names joined by `,` or `+`
/// (`syn`, `syn,ack`, `ack,psh`; also `fin`, `rst`, `urg`, `ece`, `cwr`) or the flags byte as
/// a number (`2`, `0x12`); `none` for no flag. Only with protocol tcp.
pub fn explain_tcp_flags(text: &str, protocol: u8) -> Result<u8, String> {
    use ratelimit_common::tcp_flags::{ACK, CWR, ECE, FIN, PSH, RST, SYN, URG};
    if protocol != 6 {
        return Err("tcp_flags: only meaningful with protocol tcp".to_string());
    }
    let t = text.trim().to_ascii_lowercase();
    if t == "none" {
        return Ok(0);
    }
    if let Some(hex) = t.strip_prefix("0x") {
        return u8::from_str_radix(hex, 16)
            .map_err(|_| format!("tcp_flags: {text:?} is not a flags byte"));
    }
    if let Ok(n) = t.parse::<u8>() {
        return Ok(n);
    }
    let mut flags = 0;
    for name in t.split([',', '+']).map(str::trim) {
        flags |= match name {
            "fin" => FIN,
            "syn" => SYN,
            "rst" => RST,
            "psh" => PSH,
            "ack" => ACK,
            "urg" => URG,
            "ece" => ECE,
            "cwr" => CWR,
            _ => {
                return Err(format!(
                    "tcp_flags: unknown flag {name:?}; give the packet's flags as names joined \
                     by commas (syn, ack, fin, rst, psh, urg, ece, cwr; e.g. \"syn,ack\"), \
                     \"none\", or the flags byte as a number"
                ))
            }
        };
    }
    Ok(flags)
}

/// Parses `explain`'s query: the address, the IP protocol number (`icmp` is ICMPv6 for an IPv6
/// address) and the destination port.
pub fn explain_args(
    ip: Option<&str>,
    protocol: Option<&str>,
    dst_port: Option<&str>,
) -> Result<(IpAddr, u8, Option<u16>), String> {
    let ip = ip.ok_or("ip: missing (e.g. ?ip=198.51.100.7)")?;
    let ip: IpAddr = ip
        .parse()
        .map_err(|_| format!("ip: {ip:?} is not an IPv4 or IPv6 address"))?;
    let protocol = match protocol {
        None => 0,
        Some(p) => match Protocol::from_str(p) {
            Ok(Protocol::Tcp) => 6,
            Ok(Protocol::Udp) => 17,
            Ok(Protocol::Icmp) => {
                if ip.is_ipv4() {
                    1
                } else {
                    58
                }
            }
            Ok(Protocol::Any) => 0,
            Err(e) => p
                .parse::<u8>()
                .map_err(|_| format!("protocol: {e}, or a protocol number"))?,
        },
    };
    let dst_port = dst_port
        .map(|p| {
            p.parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| format!("dst_port: {p:?} is not a port between 1 and 65535"))
        })
        .transpose()?;
    if dst_port.is_some() && !matches!(protocol, 6 | 17) {
        return Err("dst_port: only meaningful with protocol tcp or udp".to_string());
    }
    Ok((ip, protocol, dst_port))
}

async fn detach<B: Backend>(State(b): State<B>, body: Bytes) -> ApiResult {
    let iface = if body.iter().all(u8::is_ascii_whitespace) {
        None
    } else {
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("the request body is not JSON: {e}")))?;
        match v.get("iface") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "iface: expected a string, got {other}"
                )))
            }
        }
    };
    b.detach(iface).await.map(Json)
}

/// Builds a rule from its JSON object (the config file's keys and spellings) and validates it,
/// through the config file's own parser ([`crate::config::Config::parse_rule`]): the object is
/// written as one `[[rule]]` table, so a rule gets the same defaults, ranges and messages by
/// either way in. `null` stands for a key not given. The error names the rule and the key at
/// fault, as the file's message does after its file and line.
pub fn rule_from_json(v: &Value) -> Result<RuleConfig, String> {
    let obj = v
        .as_object()
        .ok_or_else(|| format!("a rule must be a JSON object, got {v}"))?;
    let mut rules = toml::Table::new();
    rules.insert(
        "rule".to_owned(),
        toml::Value::Array(vec![toml::Value::Table(toml_table(obj)?)]),
    );
    let text = toml::to_string(&rules).map_err(|e| format!("the rule cannot be read: {e}"))?;
    let mut rule =
        crate::config::Config::parse_rule(&text, "request").map_err(|e| e.without_place())?;
    // A rule from the API has no line until the config file it is written to gives it one.
    rule.line = 0;
    Ok(rule)
}

/// A JSON object as a TOML table: `null` values left out (a key not given), numbers as TOML
/// integers where they are whole (the config's checks give the ranges), other values as they
/// are. TOML has no integer above `i64::MAX`: such a number is refused here, naming its key.
fn toml_table(obj: &serde_json::Map<String, Value>) -> Result<toml::Table, String> {
    let mut t = toml::Table::new();
    for (key, value) in obj {
        if let Some(v) = toml_value(value, key)? {
            t.insert(key.clone(), v);
        }
    }
    Ok(t)
}

fn toml_value(v: &Value, key: &str) -> Result<Option<toml::Value>, String> {
    Ok(Some(match v {
        Value::Null => return Ok(None),
        Value::Bool(b) => toml::Value::Boolean(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => toml::Value::Integer(i),
            (None, _) if n.is_u64() => {
                return Err(format!("field `{key}`: {n} is out of range"));
            }
            (None, Some(f)) => toml::Value::Float(f),
            (None, None) => return Err(format!("field `{key}`: {n} is not a number")),
        },
        Value::String(s) => toml::Value::String(s.clone()),
        Value::Array(items) => toml::Value::Array(
            items
                .iter()
                .map(|item| {
                    toml_value(item, key)?
                        .ok_or_else(|| format!("field `{key}`: null inside an array"))
                })
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(o) => toml::Value::Table(toml_table(o)?),
    }))
}

#[cfg(test)]
mod tests;
