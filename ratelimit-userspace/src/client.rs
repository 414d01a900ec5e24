//! The control API's client, used by the `ratelimit` CLI: one HTTP/1.1 request per connection
//! to the agent's Unix socket, JSON in and out (routes and shapes: see [`crate::api`]).

use std::{
    io::ErrorKind,
    path::{Path, PathBuf},
    time::Duration,
};

use http_body_util::{BodyExt as _, Full};
use hyper::{body::Bytes, header, Method, Request};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

/// How long an answer may take beyond the time the request itself asks for (`top`'s interval).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a request got no answer, or was refused.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens on the socket (no such file, connection refused, no permission).
    #[error("cannot reach the agent at {} ({}): {}", socket.display(), os_message(error), hint(error))]
    Unreachable {
        /// The socket tried.
        socket: PathBuf,
        /// Why connecting failed (part of the message, so not a `source`).
        error: std::io::Error,
    },
    /// The agent refused the request; the message says why.
    #[error("{message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// The agent's `error` message.
        message: String,
    },
    /// The connection failed mid-request or the answer was not what the API sends.
    #[error("talking to the agent at {}: {message}", socket.display())]
    Protocol {
        /// The socket.
        socket: PathBuf,
        /// What went wrong.
        message: String,
    },
}

impl ClientError {
    /// Whether the agent could not be reached at all (as opposed to refusing a request).
    #[must_use]
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Self::Unreachable { .. })
    }

    /// Why connecting failed, for an unreachable agent: "No such file or directory" etc.
    #[must_use]
    pub fn unreachable_reason(&self) -> Option<String> {
        match self {
            Self::Unreachable { error, .. } => Some(os_message(error)),
            _ => None,
        }
    }
}

/// The OS error without Rust's " (os error N)" suffix.
fn os_message(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.rfind(" (os error ") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

fn hint(e: &std::io::Error) -> &'static str {
    if e.kind() == ErrorKind::PermissionDenied {
        "the control socket is root-only: run this as root"
    } else {
        "is it running? start it with `ratelimit agent -c /etc/ratelimit/ratelimit.toml`"
    }
}

/// A client of the agent listening on one socket.
#[derive(Clone, Debug)]
pub struct Client {
    socket: PathBuf,
}

impl Client {
    /// A client of the agent at `socket` (nothing is connected until a request).
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
        }
    }

    /// The socket.
    #[must_use]
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `GET /v1/status`.
    pub async fn status(&self) -> Result<Value, ClientError> {
        self.request(Method::GET, "/v1/status", None).await
    }

    /// `GET /v1/cluster`.
    pub async fn cluster(&self) -> Result<Value, ClientError> {
        self.request(Method::GET, "/v1/cluster", None).await
    }

    /// `GET /v1/rules`.
    pub async fn rules(&self) -> Result<Value, ClientError> {
        self.request(Method::GET, "/v1/rules", None).await
    }

    /// `POST /v1/rules`: adds `rule` (an object with the config file's keys); with `force`, even
    /// when the config file's rules are not those in force.
    pub async fn add_rule(&self, rule: &Value, force: bool) -> Result<Value, ClientError> {
        let path = if force {
            "/v1/rules?force=true"
        } else {
            "/v1/rules"
        };
        self.request(Method::POST, path, Some(rule)).await
    }

    /// `DELETE /v1/rules/{name}`; `force` as for [`Client::add_rule`].
    pub async fn remove_rule(&self, name: &str, force: bool) -> Result<Value, ClientError> {
        let query = if force { "?force=true" } else { "" };
        self.request(
            Method::DELETE,
            &format!("/v1/rules/{}{query}", encode(name)),
            None,
        )
        .await
    }

    /// `POST /v1/reload`: the agent re-reads its config file.
    pub async fn reload(&self) -> Result<Value, ClientError> {
        self.request(Method::POST, "/v1/reload", None).await
    }

    /// `GET /v1/stats`.
    pub async fn stats(&self) -> Result<Value, ClientError> {
        self.request(Method::GET, "/v1/stats", None).await
    }

    /// `GET /v1/top`: the `n` busiest buckets over `interval_ms`.
    pub async fn top(
        &self,
        n: usize,
        interval_ms: u64,
        limit: Option<usize>,
    ) -> Result<Value, ClientError> {
        let mut path = format!("/v1/top?n={n}&interval_ms={interval_ms}");
        if let Some(l) = limit {
            path.push_str(&format!("&limit={l}"));
        }
        let timeout = ANSWER_TIMEOUT + Duration::from_millis(interval_ms);
        self.request_within(Method::GET, &path, None, timeout).await
    }

    /// `GET /v1/suggest` for `query` (checked by [`crate::api::suggest_query`]).
    pub async fn suggest(
        &self,
        query: &crate::learn::suggest::Query,
    ) -> Result<Value, ClientError> {
        let mut path = format!(
            "/v1/suggest?quantile={}&headroom={}&since_secs={}",
            query.quantile, query.headroom, query.since_secs
        );
        if let Some(rule) = &query.rule {
            // A valid rule name is letters, digits, `_`, `.` and `-`: nothing to escape.
            path.push_str(&format!("&rule={rule}"));
        }
        self.request(Method::GET, &path, None).await
    }

    /// `POST /v1/suggest/apply`: sets limit `limit` of `rule` to `rate` and `burst`.
    pub async fn apply_limit(
        &self,
        rule: &str,
        (limit, rate, burst): (u64, u64, u64),
        force: bool,
    ) -> Result<Value, ClientError> {
        let path = if force {
            "/v1/suggest/apply?force=true"
        } else {
            "/v1/suggest/apply"
        };
        let body =
            serde_json::json!({ "rule": rule, "limit": limit, "rate": rate, "burst": burst });
        self.request(Method::POST, path, Some(&body)).await
    }

    /// `GET /v1/explain`.
    pub async fn explain(
        &self,
        ip: &str,
        protocol: Option<&str>,
        dst_port: Option<u16>,
        tcp_flags: Option<&str>,
    ) -> Result<Value, ClientError> {
        let mut path = format!("/v1/explain?ip={}", encode(ip));
        if let Some(p) = protocol {
            path.push_str(&format!("&protocol={}", encode(p)));
        }
        if let Some(p) = dst_port {
            path.push_str(&format!("&dst_port={p}"));
        }
        if let Some(f) = tcp_flags {
            path.push_str(&format!("&tcp_flags={}", encode(f)));
        }
        self.request(Method::GET, &path, None).await
    }

    /// `POST /v1/detach`: from `iface`, or from every interface.
    pub async fn detach(&self, iface: Option<&str>) -> Result<Value, ClientError> {
        let body = iface.map(|i| json!({ "iface": i }));
        self.request(Method::POST, "/v1/detach", body.as_ref())
            .await
    }

    /// Sends one request and returns the answer's JSON; a 4xx/5xx answer becomes
    /// [`ClientError::Refused`] with the agent's message.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ClientError> {
        self.request_within(method, path, body, ANSWER_TIMEOUT)
            .await
    }

    async fn request_within(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|error| ClientError::Unreachable {
                socket: self.socket.clone(),
                error,
            })?;
        let exchange = self.exchange(stream, method, path, body);
        tokio::time::timeout(timeout, exchange)
            .await
            .unwrap_or_else(|_| {
                Err(self.protocol(format!("no answer within {} s", timeout.as_secs())))
            })
    }

    async fn exchange(
        &self,
        stream: tokio::net::UnixStream,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ClientError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| self.protocol(format!("{what}: {e}"));
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| fail("handshake", &e))?;
        let conn = tokio::spawn(conn);
        let bytes = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "agent")
            .header(header::ACCEPT, "application/json");
        if body.is_some() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(bytes))
            .map_err(|e| fail("building the request", &e))?;
        let res = sender
            .send_request(req)
            .await
            .map_err(|e| fail("sending the request", &e))?;
        let status = res.status();
        let body = res
            .into_body()
            .collect()
            .await
            .map_err(|e| fail("reading the answer", &e))?
            .to_bytes();
        conn.abort();
        let value: Result<Value, _> = serde_json::from_slice(&body);
        if status.is_success() {
            return value.map_err(|e| fail("the answer is not JSON", &e));
        }
        let message = match value {
            Ok(v) => v
                .get("error")
                .and_then(Value::as_str)
                .map_or_else(|| v.to_string(), str::to_string),
            Err(_) => String::from_utf8_lossy(&body).trim().to_string(),
        };
        Err(ClientError::Refused {
            status: status.as_u16(),
            message,
        })
    }

    fn protocol(&self, message: String) -> ClientError {
        ClientError::Protocol {
            socket: self.socket.clone(),
            message,
        }
    }
}

/// Percent-encodes everything but unreserved characters, for a path segment or query value.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_names_and_addresses() {
        assert_eq!(encode("dns-1.a_b"), "dns-1.a_b");
        assert_eq!(encode("2001:db8::1"), "2001%3Adb8%3A%3A1");
        assert_eq!(encode("a b/c"), "a%20b%2Fc");
    }

    #[tokio::test]
    async fn a_missing_agent_says_how_to_start_it() {
        let socket =
            std::env::temp_dir().join(format!("rl-client-{}-missing.sock", std::process::id()));
        let e = Client::new(&socket).status().await.unwrap_err();
        assert!(e.is_unreachable());
        assert_eq!(
            e.to_string(),
            format!(
                "cannot reach the agent at {} (No such file or directory): is it running? start it \
                 with `ratelimit agent -c /etc/ratelimit/ratelimit.toml`",
                socket.display()
            )
        );
    }
}
