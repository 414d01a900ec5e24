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
//! curl --unix-socket /run/ratelimit/agent.sock 'http://agent/v1/suggest?quantile=0.99&headroom=1.5&since_secs=3600'
//! ```
//!
//! `GET /v1/suggest` (`rule`, `quantile` in (0, 1], default 0.99, `headroom` at least 1, default
//! 1.5, `since_secs` 1 to 86400, default 3600) answers `{"since_secs", "quantile", "headroom",
//! "suggestions": [{"rule", "limit", "sources", "observed": {"peak_1s", "peak_10s", "burst"},
//! "proposed": {"rate", "burst"}, "current", "tcp", "reasons", "effect": {"limited_sources",
//! "limited_share", "limited_heaviest": [{"source", "peak_1s", "peak_10s", "burst"}]},
//! "histogram": [{"up_to", "sources"}]}]}`, each of `observed` being
//! `{"p50", "p90", "p99", "p999", "max", "q"}` (`q` at the quantile asked); 404 for a rule not in
//! force. `POST /v1/suggest/apply` (`?force` as for rules) with `{"rule", "limit", "rate",
//! "burst"}` sets that limit's packet rate and burst as `rules add` would a rule (validated,
//! applied whole, written back): `{"applied": {"rule", "limit", "rate", "burst"}}`.
//!
//! # Layout
//! This file holds the socket ([`bind`], [`serve`]) and [`Backend`], the operations behind the
//! routes. `routes.rs` is the [`router`] and its handlers, which parse and validate each request;
//! `state.rs` is the agent's [`Backend`] ([`ApiState`]); `error.rs` is [`ApiError`] and the error
//! answers; `rule_json.rs` reads a rule sent as JSON; `top.rs` measures `top`.

mod error;
#[cfg(any(test, feature = "harness"))]
pub mod harness;
mod routes;
mod rule_json;
mod state;
mod top;

use std::{
    fs,
    future::Future,
    io::ErrorKind,
    net::IpAddr,
    os::unix::fs::{DirBuilderExt as _, FileTypeExt as _, PermissionsExt as _},
    path::Path,
    time::Duration,
};

use axum::http::Method;
use serde_json::Value;

pub use self::{
    error::ApiError,
    routes::{explain_args, explain_tcp_flags, router, suggest_query},
    rule_json::rule_from_json,
    state::ApiState,
    top::{top_entries, TopBaseline, TopEntry, TopRanker, TopReport, BASELINE_BUDGET},
};
use crate::{agent::AgentError, config::RuleConfig, learn::suggest::Query};

/// Default and bounds of `top`'s `interval_ms`.
pub const TOP_INTERVAL_MS: (u64, u64, u64) = (1000, 10, 60_000);
/// Default and largest `top` `n`.
pub const TOP_N: (usize, usize) = (10, 100_000);

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

/// Whether the API request `method` `path` takes a body: only `POST /v1/rules` (the rule),
/// `POST /v1/detach` (the interface) and `POST /v1/suggest/apply` (the limit) do; a body on any
/// other request is refused unread.
#[must_use]
pub fn takes_body(method: &Method, path: &str) -> bool {
    method == Method::POST && matches!(path, "/v1/rules" | "/v1/detach" | "/v1/suggest/apply")
}

/// What the API's handlers do once a request is parsed and validated: one method per operation,
/// each answering the JSON body of a success. [`ApiState`] does it on the agent; tests and the
/// fuzzer use [`harness::Recorder`], which records what it is asked.
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
    /// `GET /v1/suggest`: `query` checked by [`suggest_query`] (quantile in (0, 1], headroom at
    /// least 1, since within a day; the rule, if any, a valid name).
    fn suggest(&self, query: Query) -> impl Future<Output = Result<Value, ApiError>> + Send;
    /// `POST /v1/suggest/apply`: `limit` in 1..=[`ratelimit_common::MAX_LIMITS`], `rate` in
    /// 1..=[`crate::config::MAX_RATE`], `burst` at least 1, `rule` a valid name.
    fn apply_limit(
        &self,
        rule: String,
        limit_rate_burst: (usize, u64, u64),
        force: bool,
    ) -> impl Future<Output = Result<Value, ApiError>> + Send;
}

#[cfg(test)]
mod tests;
