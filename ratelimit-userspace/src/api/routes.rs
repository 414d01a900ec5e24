//! The routes ([`router`]) and their handlers: each parses and validates its request (query,
//! path, body) and calls the [`Backend`] only with what passed. Its own room because these are
//! the API's input checks, shared by the agent, the tests and the fuzzer whatever the backend.

use std::{net::IpAddr, str::FromStr, time::Duration};

use axum::{
    body::Bytes,
    extract::{
        rejection::{PathRejection, QueryRejection},
        Path as UrlPath, Query, State,
    },
    http::StatusCode,
    routing::{delete, get, post},
    Json, Router,
};
use serde::Deserialize;
use serde_json::Value;

use super::{
    error::{no_method, no_route, ApiResult},
    rule_from_json, ApiError, Backend, TOP_INTERVAL_MS, TOP_N,
};
use crate::{
    config::Protocol,
    learn::{history::DAY_SECS, suggest::Query as SuggestArgs},
};

/// The API's routes over `backend`: [`ApiState`] in the agent, [`harness::Recorder`] in tests and
/// the fuzzer. Every request is parsed and validated here, in the handlers; the backend is only
/// called with what passed.
///
/// [`ApiState`]: super::ApiState
/// [`harness::Recorder`]: super::harness::Recorder
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
        .route("/v1/suggest", get(suggest::<B>))
        .route("/v1/suggest/apply", post(suggest_apply::<B>))
        .fallback(no_route)
        .method_not_allowed_fallback(no_method)
        .with_state(backend)
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

/// Query of `GET /v1/suggest`: strings, so that a bad value gets our message.
#[derive(Deserialize)]
pub struct SuggestQuery {
    rule: Option<String>,
    quantile: Option<String>,
    headroom: Option<String>,
    since_secs: Option<String>,
}

/// Checks `suggest`'s arguments: the quantile in (0, 1], the headroom at least 1 (and at most
/// 1000), `since_secs` 1 to a day, the rule a valid name.
///
/// # Errors
/// What is wrong, naming the argument.
pub fn suggest_query(
    rule: Option<&str>,
    quantile: Option<&str>,
    headroom: Option<&str>,
    since_secs: Option<&str>,
) -> Result<SuggestArgs, String> {
    let (dq, dh, ds) = crate::learn::suggest::DEFAULTS;
    let num = |s: Option<&str>, d: f64| -> Result<f64, String> {
        s.map_or(Ok(d), |s| {
            s.parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or_else(|| format!("{s:?} is not a number"))
        })
    };
    let quantile = num(quantile, dq).map_err(|e| format!("quantile: {e}"))?;
    if !(quantile > 0.0 && quantile <= 1.0) {
        return Err(format!("quantile: {quantile} is not in (0, 1]"));
    }
    let headroom = num(headroom, dh).map_err(|e| format!("headroom: {e}"))?;
    if !(1.0..=1000.0).contains(&headroom) {
        return Err(format!("headroom: {headroom} is not between 1 and 1000"));
    }
    let since_secs = match since_secs {
        None => ds,
        Some(s) => s
            .parse::<u64>()
            .ok()
            .filter(|v| (1..=DAY_SECS).contains(v))
            .ok_or_else(|| {
                format!("since_secs: {s:?} is not a number of seconds between 1 and {DAY_SECS}")
            })?,
    };
    if let Some(name) = rule {
        crate::config::validate_name(name).map_err(|e| format!("rule: {e}"))?;
    }
    Ok(SuggestArgs {
        rule: rule.map(str::to_owned),
        quantile,
        headroom,
        since_secs,
    })
}

async fn suggest<B: Backend>(
    State(b): State<B>,
    q: Result<Query<SuggestQuery>, QueryRejection>,
) -> ApiResult {
    let Query(q) = q?;
    let query = suggest_query(
        q.rule.as_deref(),
        q.quantile.as_deref(),
        q.headroom.as_deref(),
        q.since_secs.as_deref(),
    )
    .map_err(ApiError::bad_request)?;
    b.suggest(query).await.map(Json)
}

/// Body of `POST /v1/suggest/apply`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApplyBody {
    rule: String,
    limit: usize,
    rate: u64,
    burst: u64,
}

async fn suggest_apply<B: Backend>(
    State(b): State<B>,
    q: Result<Query<ChangeQuery>, QueryRejection>,
    body: Bytes,
) -> ApiResult {
    let force = q?.force()?;
    let a: ApplyBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(format!(
            "the request body is not {{\"rule\", \"limit\", \"rate\", \"burst\"}}: {e}"
        ))
    })?;
    crate::config::validate_name(&a.rule)
        .map_err(|e| ApiError::bad_request(format!("rule: {e}")))?;
    crate::learn::suggest::check_apply((a.limit, a.rate, a.burst))
        .map_err(ApiError::bad_request)?;
    b.apply_limit(a.rule, (a.limit, a.rate, a.burst), force)
        .await
        .map(Json)
}
