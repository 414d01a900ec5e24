//! The control API driven over an in-memory connection, for the unit tests and the `api_http`
//! fuzz target (the agent does not use it):
//! - [`Recorder`], a [`Backend`] that records what the handlers ask of it and answers from a
//!   small model of an agent (rules by name, two interfaces);
//! - [`exchange`], which sends one client's bytes through the real [`crate::http::serve`] and
//!   [`router`] over a [`Recorder`], and reads back everything the server writes;
//! - [`check`], the properties every exchange must have, whatever the client sent.
//!
//! Run [`exchange`] on a current-thread runtime with tokio's clock paused (`start_paused`): the
//! whole input is sent at once, so nothing should ever wait on a timer, and a stall shows at
//! once (as [`Exchange::stalled`]) instead of after seconds.

use std::{
    net::IpAddr,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};

use super::{router, rule_from_json, ApiError, Backend, TOP_INTERVAL_MS, TOP_N};
use crate::{
    agent::AgentError,
    compile::{compile, RuleIds},
    config::RuleConfig,
    http::{Accept, Limits},
};

/// The limits [`exchange`] serves with: small enough that a fuzzed input reaches them (a body
/// over 1 KiB is refused with 413), long timeouts that a paused clock only reaches on a stall.
pub const LIMITS: Limits = Limits {
    max_connections: 4,
    header_timeout: Duration::from_secs(5),
    body_timeout: Duration::from_secs(5),
    max_body: 1024,
    takes_body: super::takes_body,
};

/// How long (on the paused clock) an exchange may take before it counts as stalled.
const STALL: Duration = Duration::from_secs(60);

/// How long the client of [`Close::WhenIdle`] waits before it shuts its side down: shorter than
/// [`LIMITS`]' timeouts, so that they never fire. On a paused clock this wait ends as soon as
/// nothing else can run, that is once the server has done all it can with the input.
const IDLE: Duration = Duration::from_secs(1);

/// When the client shuts its side of the connection down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Close {
    /// Once the server has done all it can with the input (needs the paused clock): every
    /// request the server can read is answered, as for a client that waits for its answers.
    WhenIdle,
    /// Right after the input, as a client that half-closes once it has sent (`nc -N`): every
    /// whole request is still answered (the server takes half-closed connections), a truncated
    /// one is not; this exercises the server's end-of-file paths.
    AtOnce,
}

/// The interfaces the [`Recorder`]'s agent has attached.
pub const INTERFACES: [&str; 2] = ["eth0", "eth1"];

/// One thing the handlers asked of the backend, with the arguments they passed.
#[derive(Clone, Debug, PartialEq)]
pub enum Call {
    /// `status`.
    Status,
    /// `rules list`.
    Rules,
    /// `rules add`.
    AddRule {
        /// The rule.
        rule: Box<RuleConfig>,
        /// `?force`.
        force: bool,
    },
    /// `rules remove`.
    RemoveRule {
        /// The rule's name.
        name: String,
        /// `?force`.
        force: bool,
    },
    /// `rules reload`.
    Reload,
    /// `stats`.
    Stats,
    /// `peers`.
    Cluster,
    /// `top`.
    Top {
        /// How many buckets.
        n: usize,
        /// The measuring interval.
        interval: Duration,
        /// Which limit of the rules.
        limit: Option<usize>,
    },
    /// `explain`.
    Explain {
        /// The address.
        ip: IpAddr,
        /// The IP protocol number (0: any).
        protocol: u8,
        /// The destination port.
        dst_port: Option<u16>,
        /// The TCP flags byte.
        tcp_flags: Option<u8>,
    },
    /// `detach`.
    Detach {
        /// One interface, or all.
        iface: Option<String>,
    },
    /// `suggest --apply`: the rule's name, (limit, rate, burst), `?force`.
    ApplyLimit(String, (usize, u64, u64), bool),
    /// `suggest`: what was asked.
    Suggest(crate::learn::suggest::Query),
}

impl Call {
    /// Whether the handlers validated what they passed: the values the real agent relies on.
    ///
    /// # Errors
    /// What is out of bounds, naming the call.
    pub fn check(&self) -> Result<(), String> {
        match self {
            Call::Top { n, interval, limit } => {
                if !(1..=TOP_N.1).contains(n) {
                    return Err(format!("top called with n = {n}, not in 1..={}", TOP_N.1));
                }
                let (_, min, max) = TOP_INTERVAL_MS;
                let ms = interval.as_millis();
                if !(u128::from(min)..=u128::from(max)).contains(&ms)
                    || interval.subsec_nanos() % 1_000_000 != 0
                {
                    return Err(format!(
                        "top called with an interval of {interval:?}, not whole ms in {min}..={max}"
                    ));
                }
                if let Some(l) = limit {
                    if !(1..=ratelimit_common::MAX_LIMITS).contains(l) {
                        return Err(format!(
                            "top called with limit {l}, not in 1..={}",
                            ratelimit_common::MAX_LIMITS
                        ));
                    }
                }
            }
            Call::Explain {
                protocol,
                dst_port,
                tcp_flags,
                ..
            } => {
                if *dst_port == Some(0) {
                    return Err("explain called with dst_port 0".into());
                }
                if dst_port.is_some() && !matches!(protocol, 6 | 17) {
                    return Err(format!(
                        "explain called with a dst_port and protocol {protocol}"
                    ));
                }
                if tcp_flags.is_some() && *protocol != 6 {
                    return Err(format!(
                        "explain called with tcp_flags and protocol {protocol}"
                    ));
                }
            }
            Call::AddRule { rule, .. } => {
                rule.validate()
                    .map_err(|e| format!("rules add called with an invalid rule: {e:?}"))?;
                compile(std::slice::from_ref(rule), &RuleIds::new()).map_err(|e| {
                    format!("rules add called with a rule that does not compile: {e}")
                })?;
                // What `rules list` shows of it is accepted back as the same rule.
                let shown = serde_json::to_value(&**rule).map_err(|e| e.to_string())?;
                if rule_from_json(&shown).as_ref() != Ok(&**rule) {
                    return Err(format!("rules add called with a rule shown as {shown}, which does not read back as itself"));
                }
            }
            Call::RemoveRule { name, .. } => {
                if name.is_empty() {
                    return Err("rules remove called with an empty name".into());
                }
            }
            Call::Status
            | Call::Rules
            | Call::Reload
            | Call::Stats
            | Call::Cluster
            | Call::Detach { .. } => {}
            Call::ApplyLimit(_, lrb, _) => crate::learn::suggest::check_apply(*lrb)?,
            Call::Suggest(query) => query.check()?,
        }
        Ok(())
    }
}

/// What the backend answered a call: the JSON of a success, or the error's status and message.
pub type Answer = Result<Value, (u16, String)>;

/// The agent the [`Recorder`] models, and what it was asked.
#[derive(Debug)]
struct Model {
    calls: Vec<(Call, Answer)>,
    rules: Vec<RuleConfig>,
    attached: Vec<String>,
}

/// A [`Backend`] that records every call and answers from a model of an agent: rules are
/// added (409 when the name is taken or the set would not compile) and removed (404 when
/// missing) by name, `detach` knows [`INTERFACES`] (400 for another); never a 500.
#[derive(Clone, Debug)]
pub struct Recorder(Arc<Mutex<Model>>);

impl Default for Recorder {
    fn default() -> Self {
        let default =
            rule_from_json(&json!({"name": "default", "source": "0.0.0.0/0", "rate": 1000}))
                .expect("a valid rule");
        Self(Arc::new(Mutex::new(Model {
            calls: Vec::new(),
            rules: vec![default],
            attached: INTERFACES.map(String::from).to_vec(),
        })))
    }
}

impl Recorder {
    /// The calls so far, with their answers.
    #[must_use]
    pub fn calls(&self) -> Vec<(Call, Answer)> {
        self.model().calls.clone()
    }

    fn model(&self) -> std::sync::MutexGuard<'_, Model> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records `call` and `answer`'s outcome (`answer` runs under the model's lock).
    fn answer(
        &self,
        call: Call,
        answer: impl FnOnce(&mut Model) -> Result<Value, ApiError>,
    ) -> Result<Value, ApiError> {
        let mut model = self.model();
        let result = answer(&mut model);
        let recorded = match &result {
            Ok(v) => Ok(v.clone()),
            Err(e) => Err((e.status().as_u16(), e.message().to_string())),
        };
        model.calls.push((call, recorded));
        result
    }
}

impl Backend for Recorder {
    async fn status(&self) -> Result<Value, ApiError> {
        self.answer(Call::Status, |m| {
            Ok(json!({ "rules": m.rules.len(), "interfaces": m.attached }))
        })
    }

    async fn rules(&self) -> Result<Value, ApiError> {
        self.answer(Call::Rules, |m| Ok(json!({ "rules": m.rules })))
    }

    async fn add_rule(&self, rule: RuleConfig, force: bool) -> Result<Value, ApiError> {
        let call = Call::AddRule {
            rule: Box::new(rule.clone()),
            force,
        };
        self.answer(call, |m| {
            if m.rules.iter().any(|r| r.name == rule.name) {
                return Err(AgentError::RuleExists(rule.name).into());
            }
            let mut rules = m.rules.clone();
            rules.push(rule.clone());
            compile(&rules, &RuleIds::new()).map_err(|source| AgentError::Compile {
                origin: "API request".into(),
                source,
            })?;
            m.rules = rules;
            Ok(json!({ "added": rule, "rules": m.rules.len() }))
        })
    }

    async fn remove_rule(&self, name: String, force: bool) -> Result<Value, ApiError> {
        let call = Call::RemoveRule {
            name: name.clone(),
            force,
        };
        self.answer(call, |m| {
            let before = m.rules.len();
            m.rules.retain(|r| r.name != name);
            if m.rules.len() == before {
                return Err(AgentError::NoSuchRule(name).into());
            }
            Ok(json!({ "removed": name, "rules": m.rules.len() }))
        })
    }

    async fn reload(&self) -> Result<Value, ApiError> {
        self.answer(Call::Reload, |m| {
            Ok(json!({ "reloaded": true, "rules": m.rules.len(), "restart_needed": [] }))
        })
    }

    async fn stats(&self) -> Result<Value, ApiError> {
        self.answer(Call::Stats, |m| {
            let names: Vec<&str> = m.rules.iter().map(|r| r.name.as_str()).collect();
            Ok(json!({ "rules": names }))
        })
    }

    async fn cluster(&self) -> Result<Value, ApiError> {
        self.answer(Call::Cluster, |_| Ok(json!({ "members": [] })))
    }

    async fn top(
        &self,
        n: usize,
        interval: Duration,
        limit: Option<usize>,
    ) -> Result<Value, ApiError> {
        let call = Call::Top { n, interval, limit };
        self.answer(call, |_| {
            Ok(json!({ "interval_ms": interval.as_millis(), "n": n, "limit": limit, "top": [] }))
        })
    }

    async fn explain(
        &self,
        ip: IpAddr,
        protocol: u8,
        dst_port: Option<u16>,
        tcp_flags: Option<u8>,
    ) -> Result<Value, ApiError> {
        let call = Call::Explain {
            ip,
            protocol,
            dst_port,
            tcp_flags,
        };
        self.answer(call, |_| {
            Ok(json!({ "ip": ip, "protocol": protocol, "dst_port": dst_port, "tcp_flags": tcp_flags }))
        })
    }

    async fn apply_limit(
        &self,
        r: String,
        lrb: (usize, u64, u64),
        f: bool,
    ) -> Result<Value, ApiError> {
        let answer = json!({ "applied": { "rule": r } });
        self.answer(Call::ApplyLimit(r, lrb, f), |_| Ok(answer))
    }

    async fn suggest(&self, q: crate::learn::suggest::Query) -> Result<Value, ApiError> {
        let answer = json!({ "since_secs": q.since_secs, "suggestions": [] });
        self.answer(Call::Suggest(q), |_| Ok(answer))
    }

    async fn detach(&self, iface: Option<String>) -> Result<Value, ApiError> {
        let call = Call::Detach {
            iface: iface.clone(),
        };
        self.answer(call, |m| {
            let done = match iface {
                Some(name) if !INTERFACES.contains(&name.as_str()) => {
                    return Err(AgentError::NoSuchInterface {
                        name,
                        origin: "the request".into(),
                    }
                    .into())
                }
                Some(name) => {
                    m.attached.retain(|a| *a != name);
                    vec![name]
                }
                None => std::mem::take(&mut m.attached),
            };
            Ok(json!({ "detached": done }))
        })
    }
}

/// A listener with one connection, then none.
struct OneConnection(Option<DuplexStream>);

impl Accept for OneConnection {
    type Io = DuplexStream;
    async fn accept(&mut self) -> std::io::Result<DuplexStream> {
        match self.0.take() {
            Some(io) => Ok(io),
            None => std::future::pending().await,
        }
    }
}

/// One client's exchange with the API.
#[derive(Debug)]
pub struct Exchange {
    /// What the client sent (all of it, then it shut its side down).
    pub input: Vec<u8>,
    /// Everything the server wrote until it closed the connection.
    pub output: Vec<u8>,
    /// What the handlers asked of the backend, in order, with its answers.
    pub calls: Vec<(Call, Answer)>,
    /// The server had not closed the connection [`STALL`] after the input was sent.
    pub stalled: bool,
}

/// Sends `input` as one client over an in-memory connection to the real [`crate::http::serve`]
/// (with [`LIMITS`]) and [`router`] over a fresh [`Recorder`], shuts the client's side down as
/// `close` says, and reads until the server closes. Writing and reading run together, so a
/// server blocked on writing its answers never stops the client. Needs a current-thread tokio
/// runtime with the clock paused.
pub async fn exchange(input: &[u8], close: Close) -> Exchange {
    let recorder = Recorder::default();
    let (client, server) = tokio::io::duplex(64 * 1024);
    let serving = tokio::spawn(crate::http::serve(
        OneConnection(Some(server)),
        router(recorder.clone()),
        LIMITS,
        "control API harness",
    ));
    let (mut rd, mut wr) = tokio::io::split(client);
    let write = async {
        // The server may close first (after refusing a request): the rest is not for it.
        if wr.write_all(input).await.is_ok() {
            if close == Close::WhenIdle {
                tokio::time::sleep(IDLE).await;
            }
            let _ = wr.shutdown().await;
        }
    };
    let mut output = Vec::new();
    let read = async {
        // An error is the server's side going away: what it wrote before is kept.
        let _ = rd.read_to_end(&mut output).await;
    };
    let stalled = tokio::time::timeout(STALL, async { tokio::join!(write, read) })
        .await
        .is_err();
    serving.abort();
    Exchange {
        input: input.to_vec(),
        output,
        calls: recorder.calls(),
        stalled,
    }
}

/// One response read back.
#[derive(Clone, Debug)]
pub struct Response {
    /// The status line's minor version (`HTTP/1.x`).
    pub version: u8,
    /// The status code.
    pub status: u16,
    /// The headers, names in lower case.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body; `None` when the response announced one but sent none (the answer to a `HEAD`).
    pub body: Option<Vec<u8>>,
}

impl Response {
    /// The first value of header `name` (lower case), as text.
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    fn closes(&self) -> bool {
        self.header("connection")
            .is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")))
    }
}

/// Reads every response in `out`, the bytes a server wrote on one connection.
///
/// # Errors
/// Where the bytes stop being HTTP/1.x responses.
pub fn parse_responses(out: &[u8]) -> Result<Vec<Response>, String> {
    let mut responses = Vec::new();
    let mut at = 0;
    while at < out.len() {
        let rest = &out[at..];
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut head = httparse::Response::new(&mut headers);
        let len = match head.parse(rest) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => {
                return Err(format!(
                    "response {} at byte {at}: truncated head",
                    responses.len()
                ))
            }
            Err(e) => {
                return Err(format!(
                    "response {} at byte {at}: not an HTTP response ({e}): {:?}",
                    responses.len(),
                    String::from_utf8_lossy(&rest[..rest.len().min(80)])
                ))
            }
        };
        let mut response = Response {
            version: head.version.unwrap_or(1),
            status: head.code.unwrap_or(0),
            headers: head
                .headers
                .iter()
                .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
                .collect(),
            body: Some(Vec::new()),
        };
        at += len;
        let rest = &out[at..];
        let chunked = response
            .header("transfer-encoding")
            .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
        let length = response
            .header("content-length")
            .map(|v| {
                v.parse::<usize>()
                    .map_err(|_| format!("response {}: content-length {v:?}", responses.len()))
            })
            .transpose()?;
        if (100..200).contains(&response.status) || matches!(response.status, 204 | 304) {
        } else if chunked {
            let (body, used) = dechunk(rest)
                .ok_or_else(|| format!("response {}: a broken chunked body", responses.len()))?;
            response.body = Some(body);
            at += used;
        } else if let Some(length) = length {
            // Our bodies are JSON or text, never a status line: a response followed by nothing
            // or by the next status line sent no body (it answers a HEAD).
            if length > 0 && (rest.is_empty() || rest.starts_with(b"HTTP/1.")) {
                response.body = None;
            } else if rest.len() < length {
                return Err(format!(
                    "response {}: content-length {length}, {} bytes follow",
                    responses.len(),
                    rest.len()
                ));
            } else {
                response.body = Some(rest[..length].to_vec());
                at += length;
            }
        } else {
            response.body = Some(rest.to_vec());
            at = out.len();
        }
        responses.push(response);
    }
    Ok(responses)
}

/// Decodes a chunked body at the start of `b`: the body and the bytes it took.
fn dechunk(b: &[u8]) -> Option<(Vec<u8>, usize)> {
    let mut body = Vec::new();
    let mut at = 0;
    loop {
        let line_end = at + b[at..].windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&b[at..line_end]).ok()?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        at = line_end + 2;
        if size == 0 {
            // No trailers from this server: the empty line ends the body.
            return (b.get(at..at + 2)? == b"\r\n").then_some((body, at + 2));
        }
        body.extend_from_slice(b.get(at..at + size)?);
        at += size;
        if b.get(at..at + 2)? != b"\r\n" {
            return None;
        }
        at += 2;
    }
}

/// How many requests a server could have read from `input`, at most: a request's head ends
/// with an empty line (`\n\n` or `\n\r\n`), so this counts those, none sharing a byte.
#[must_use]
pub fn complete_heads(input: &[u8]) -> usize {
    let mut count = 0;
    let mut i = 0;
    while i < input.len() {
        let end = if input[i] != b'\n' {
            None
        } else if input.get(i + 1) == Some(&b'\n') {
            Some(i + 2)
        } else if input.get(i + 1..i + 3) == Some(b"\r\n") {
            Some(i + 3)
        } else {
            None
        };
        match end {
            Some(end) => {
                count += 1;
                i = end;
            }
            None => i += 1,
        }
    }
    count
}

/// The statuses the API served by [`crate::http::serve`] can answer with, over a [`Recorder`]:
/// its handlers (200, 201; 400 refused, 404 no route or rule, 405 wrong method, 409 a rule
/// that exists or would not compile), `http::serve` (400 a broken body, 408 a slow one, 413 a
/// big one or one where none is taken) and hyper's own answers to what it cannot parse (400, 414 URI too long, 431 headers
/// too large), and hyper's `100 Continue` before a body the client waits to send. Never 500:
/// the recorder does not fail, so a 500 is the API's own fault.
pub const STATUSES: [u16; 11] = [100, 200, 201, 400, 404, 405, 408, 409, 413, 414, 431];

/// Where a refusal comes from, by its body.
fn refusal_origin(r: &Response) -> Result<&'static str, String> {
    let body = r.body.as_deref();
    let json = r
        .header("content-type")
        .is_some_and(|t| t.starts_with("application/json"));
    if json {
        let Some(body) = body else {
            return Ok("the API (HEAD)");
        };
        let v: Value = serde_json::from_slice(body).map_err(|e| {
            format!(
                "a {} says JSON but is not ({e}): {:?}",
                r.status,
                String::from_utf8_lossy(body)
            )
        })?;
        return match v.get("error").and_then(Value::as_str) {
            Some(m) if !m.trim().is_empty() && v.as_object().is_some_and(|o| o.len() == 1) => {
                Ok("the API")
            }
            _ => Err(format!(
                "a {} whose body is not {{\"error\": MESSAGE}}: {v}",
                r.status
            )),
        };
    }
    let text = body.map(String::from_utf8_lossy);
    let from_serve = [
        "reading the request body: ",
        "the request body did not arrive within ",
        "the request body is refused: ",
    ];
    match (r.status, text.as_deref()) {
        (400 | 413 | 408, Some(t)) if from_serve.iter().any(|p| t.starts_with(p)) => {
            Ok("http::serve")
        }
        (400 | 413 | 408, None) => Ok("http::serve (HEAD)"),
        (400 | 414 | 431, Some("")) => Ok("hyper"),
        (status, text) => Err(format!(
            "a {status} that is neither the API's {{\"error\": MESSAGE}}, nor http::serve's, \
             nor hyper's: content-type {:?}, body {text:?}",
            r.header("content-type")
        )),
    }
}

/// Checks the properties every exchange has, whatever the client sent:
/// - the server did not stall, and what it wrote is a sequence of HTTP/1.x responses, nothing
///   after one that says `connection: close`;
/// - each status is one of [`STATUSES`];
/// - each 2xx is a JSON object; each 4xx is the API's `{"error": MESSAGE}` with a message, or the
///   text of `http::serve`'s body limits, or hyper's empty answer to a request it cannot parse,
///   which is the last response;
/// - there are no more final responses than request heads in the input (plus hyper's one
///   answer to an unparseable one), and no more backend calls than heads;
/// - every call's arguments pass [`Call::check`];
/// - the client got each backend answer, in order (a success's status and JSON, an error's
///   status and message), save for the last calls on a connection that broke off; and every 2xx
///   it got is one of them.
///
/// Answers the responses.
///
/// # Errors
/// The property that does not hold, and where.
pub fn check(x: &Exchange) -> Result<Vec<Response>, String> {
    if x.stalled {
        return Err(format!(
            "stalled: the server had not closed the connection {STALL:?} (paused clock) after the \
             input; it wrote {} bytes",
            x.output.len()
        ));
    }
    let responses = parse_responses(&x.output)?;
    let heads = complete_heads(&x.input);
    let mut finals = 0;
    let mut from_hyper = 0;
    let mut answers = x.calls.iter().map(|(_, a)| a).peekable();
    for (i, r) in responses.iter().enumerate() {
        let at = |m: String| format!("response {i} ({}): {m}", r.status);
        if i > 0 && responses[i - 1].closes() {
            return Err(at("follows a response with connection: close".into()));
        }
        let Some((body, hyper)) = final_body(r).map_err(at)? else {
            continue;
        };
        finals += 1;
        if hyper {
            from_hyper += 1;
            if i + 1 != responses.len() {
                return Err(at(
                    "hyper's answer to an unparseable request is not the last".into(),
                ));
            }
        }
        // The backend's next answer, if this is it.
        let matches = |a: &Answer| match (a, &body) {
            (Ok(v), Some(b)) => r.status < 300 && b == v,
            (Ok(_), None) => r.status < 300,
            (Err((status, message)), Some(b)) => {
                r.status == *status && b.get("error").and_then(Value::as_str) == Some(message)
            }
            (Err((status, _)), None) => r.status == *status,
        };
        if answers.peek().is_some_and(|a| matches(a)) {
            answers.next();
        } else if r.status < 300 {
            return Err(at(format!(
                "a success the backend did not answer next (its next answer: {:?}): {body:?}",
                answers.peek()
            )));
        }
    }
    if finals - from_hyper > heads || from_hyper > 1 {
        return Err(format!(
            "{finals} responses ({from_hyper} hyper's own) to an input with {heads} request heads"
        ));
    }
    if x.calls.len() > heads {
        return Err(format!(
            "{} backend calls from an input with {heads} request heads",
            x.calls.len()
        ));
    }
    for (call, _) in &x.calls {
        call.check()?;
    }
    // Answers the client never got: none. The server takes half-closed connections, so even a
    // client that shut its side down right after sending gets the answer to every request the
    // backend saw; a missing one is a response lost.
    let unanswered: Vec<_> = answers.collect();
    if !unanswered.is_empty() {
        return Err(format!(
            "{} backend answers the client never got: {unanswered:?}",
            unanswered.len()
        ));
    }
    Ok(responses)
}

/// What [`check`] reads of one response by itself: `None` for an interim `100`; else its body
/// as JSON where it is JSON, and whether it is hyper's own answer to a request it could not
/// parse. A status outside [`STATUSES`], a 2xx that is not a JSON object, and a 4xx that is not
/// one of the refusals [`refusal_origin`] knows are errors.
fn final_body(r: &Response) -> Result<Option<(Option<Value>, bool)>, String> {
    if !STATUSES.contains(&r.status) {
        return Err(format!("status {} is not one of {STATUSES:?}", r.status));
    }
    if r.status == 100 {
        return Ok(None);
    }
    let body: Option<Value> = match &r.body {
        None => None,
        Some(b) if r.status < 300 => Some(serde_json::from_slice(b).map_err(|e| {
            format!(
                "a success that is not JSON ({e}): {:?}",
                String::from_utf8_lossy(b)
            )
        })?),
        Some(b) => serde_json::from_slice(b).ok(),
    };
    if r.status < 300 {
        if !r
            .header("content-type")
            .is_some_and(|t| t.starts_with("application/json"))
            || body.as_ref().is_some_and(|b| !b.is_object())
        {
            return Err(format!("a success that is not a JSON object: {body:?}"));
        }
        return Ok(Some((body, false)));
    }
    let hyper = refusal_origin(r)? == "hyper";
    Ok(Some((body, hyper)))
}
