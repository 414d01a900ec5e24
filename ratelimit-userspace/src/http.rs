//! Serving HTTP/1.1 with limits, for the control API ([`crate::api`]) and the metrics endpoint
//! ([`crate::metrics`]): whoever reaches an endpoint must not exhaust the agent's file
//! descriptors, memory or tasks by opening connections and sending nothing, or sending slowly.
//!
//! - At most [`Limits::max_connections`] connections are open at once. When another one arrives
//!   at the cap, the oldest *idle* connection (no whole request being answered: a connection
//!   that has not sent its request headers yet, one still sending a request body, or a
//!   keep-alive one between requests) is closed to make room; if every connection is busy
//!   answering, new ones wait in the listen backlog until one is done. So idle or slow
//!   connections, however many, never keep a real client out, and the agent holds a bounded
//!   number of descriptors (the cap, and one accepted while it waits).
//! - A request whose route takes no body ([`Limits::takes_body`]) but whose headers announce one
//!   is answered 413 and its connection closed, without reading the body.
//! - A request's headers must arrive within [`Limits::header_timeout`] (hyper's
//!   `header_read_timeout`), its body within [`Limits::body_timeout`] and be at most
//!   [`Limits::max_body`] bytes; else the connection is closed (headers) or answered 408/413.
//!
//! Built on hyper's own HTTP/1 connection (`hyper::server::conn::http1`, whose header timeout is
//! made for this; axum's `serve` exposes neither it nor a connection cap) driving the axum router.

use std::{
    collections::BTreeMap,
    convert::Infallible,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use axum::{
    body::Body,
    http::{Method, Request, StatusCode},
    response::{IntoResponse, Response},
    Router,
};
use http_body_util::{BodyExt as _, Limited};
use hyper::body::Body as _;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::Notify,
};
use tower::ServiceExt as _;

/// The limits of one server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Time for a request's headers to arrive, from the moment the server waits for them.
    pub header_timeout: Duration,
    /// Time for a request's body to arrive.
    pub body_timeout: Duration,
    /// Largest request body.
    pub max_body: usize,
    /// Whether a request (method, path) takes a body; one that does not is answered 413 and
    /// the connection closed as soon as its headers announce a body, without reading it.
    pub takes_body: fn(&Method, &str) -> bool,
}

/// [`Limits::takes_body`] for a server whose requests never take a body.
#[must_use]
pub fn no_body(_: &Method, _: &str) -> bool {
    false
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            max_body: 1 << 20,
            takes_body: |_, _| true,
        }
    }
}

/// A listener the server accepts connections from (TCP for metrics, Unix for the API).
pub trait Accept: Send + 'static {
    /// A connection.
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The next connection.
    fn accept(&mut self) -> impl std::future::Future<Output = std::io::Result<Self::Io>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&mut self) -> std::io::Result<Self::Io> {
        tokio::net::TcpListener::accept(self).await.map(|(s, _)| s)
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept(&mut self) -> std::io::Result<Self::Io> {
        tokio::net::UnixListener::accept(self).await.map(|(s, _)| s)
    }
}

/// One open connection, as the accept loop sees it.
struct Conn {
    /// Requests being answered on it.
    busy: AtomicUsize,
    /// Closes it.
    close: Notify,
}

/// The open connections, oldest first.
#[derive(Default)]
struct Table {
    next: u64,
    open: BTreeMap<u64, Arc<Conn>>,
}

/// Serves `router` on `listener` with `limits` until the task is aborted. `what` names the server
/// in the log.
pub async fn serve<L: Accept>(mut listener: L, router: Router, limits: Limits, what: &'static str) {
    let table = Arc::new(Mutex::new(Table::default()));
    let mut waiting_logged = false;
    let mut wait_logged = |waiting: bool| {
        if waiting && !waiting_logged {
            tracing::warn!(
                server = what,
                max = limits.max_connections,
                "every connection is busy answering: new ones wait until one is done"
            );
        }
        waiting_logged = waiting;
    };
    loop {
        // At the cap with every connection busy answering, new clients wait in the listen
        // backlog (no descriptor of ours) until one is done or idle, rather than being closed:
        // 64 scrapers waiting on one shared encoding are all busy at once, and a real scraper
        // arriving then was reset.
        while !has_room(&table, limits.max_connections) {
            wait_logged(true);
            tokio::time::sleep(ROOM_POLL).await;
        }
        let io = match listener.accept().await {
            Ok(io) => io,
            Err(e) => {
                // Out of descriptors or memory, or the peer gave up: not fatal. Wait a little so
                // the loop does not spin.
                tracing::warn!(server = what, error = %e, "accepting a connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // The idle connection seen above may have taken a request since: then this one (one
        // descriptor past the cap) waits for room.
        let (id, conn) = loop {
            if let Some(admitted) = admit(&table, limits.max_connections) {
                break admitted;
            }
            wait_logged(true);
            tokio::time::sleep(ROOM_POLL).await;
        };
        wait_logged(false);
        let (router, table) = (router.clone(), table.clone());
        tokio::spawn(async move {
            serve_connection(io, router, limits, &conn).await;
            table
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .open
                .remove(&id);
        });
    }
}

/// How often a server at its cap with every connection busy looks for room again.
const ROOM_POLL: Duration = Duration::from_millis(5);

impl Table {
    /// The oldest idle connection (no whole request being answered), if any.
    fn oldest_idle(&self) -> Option<u64> {
        self.open
            .iter()
            .find(|(_, c)| c.busy.load(Ordering::Acquire) == 0)
            .map(|(&id, _)| id)
    }
}

/// Whether a new connection can be admitted: fewer than `max` open, or an idle one to close.
fn has_room(table: &Mutex<Table>, max: usize) -> bool {
    let t = table
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    t.open.len() < max || t.oldest_idle().is_some()
}

/// Admits a new connection: at the cap, the oldest idle one is closed to make room; `None` if
/// every one is busy answering.
fn admit(table: &Mutex<Table>, max: usize) -> Option<(u64, Arc<Conn>)> {
    let mut t = table
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if t.open.len() >= max {
        if let Some(c) = t.oldest_idle().and_then(|id| t.open.remove(&id)) {
            c.close.notify_one();
        }
    }
    (t.open.len() < max).then(|| {
        let id = t.next;
        t.next += 1;
        let conn = Arc::new(Conn {
            busy: AtomicUsize::new(0),
            close: Notify::new(),
        });
        t.open.insert(id, conn.clone());
        (id, conn)
    })
}

/// Counts a request as being answered while it lives.
struct Busy(Arc<Conn>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn serve_connection<I>(io: I, router: Router, limits: Limits, conn: &Arc<Conn>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let for_requests = conn.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let conn = for_requests.clone();
        let router = router.clone();
        async move {
            let (parts, body) = req.into_parts();
            // A body where none is taken is refused before a byte of it is read, and the
            // connection closed: nobody holds a connection by trickling a body nothing reads.
            if !body.is_end_stream() && !(limits.takes_body)(&parts.method, parts.uri.path()) {
                let mut response = (
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "the request body is refused: {} {} takes none\n",
                        parts.method,
                        parts.uri.path()
                    ),
                )
                    .into_response();
                response.headers_mut().insert(
                    axum::http::header::CONNECTION,
                    axum::http::HeaderValue::from_static("close"),
                );
                return Ok::<_, Infallible>(response);
            }
            // Not busy while the body arrives: a connection still sending its body is as
            // evictable as an idle one, so slow bodies cannot hold the connection slots.
            let body = Limited::new(body, limits.max_body).collect();
            let bytes = match tokio::time::timeout(limits.body_timeout, body).await {
                Ok(Ok(b)) => b.to_bytes(),
                Ok(Err(e)) => {
                    let status = if e.is::<http_body_util::LengthLimitError>() {
                        StatusCode::PAYLOAD_TOO_LARGE
                    } else {
                        StatusCode::BAD_REQUEST
                    };
                    return Ok((status, format!("reading the request body: {e}\n")).into_response());
                }
                Err(_) => {
                    return Ok((
                        StatusCode::REQUEST_TIMEOUT,
                        format!(
                            "the request body did not arrive within {} s\n",
                            limits.body_timeout.as_secs()
                        ),
                    )
                        .into_response())
                }
            };
            // Busy from here: the request is whole and being answered.
            conn.busy.fetch_add(1, Ordering::AcqRel);
            let _busy = Busy(conn);
            let req = Request::from_parts(parts, Body::from(bytes));
            let response: Response = router.oneshot(req).await?;
            Ok(response)
        }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        // A client may shut its side down once it has sent its requests (`nc -N`, `curl` over
        // some proxies) and still wait for the answers: each request read is answered, then the
        // connection closes. (Off, hyper closes at end of file and the last request goes
        // unanswered.) The connection still counts against `max_connections` and its timeouts.
        .half_close(true)
        .serve_connection(TokioIo::new(io), service);
    tokio::select! {
        // An error here is the client's (it went away, sent garbage, was too slow): nothing to
        // report.
        _ = connection => {}
        () = conn.close.notified() => {}
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use axum::{routing::get, Router};
    use tokio::{
        io::{AsyncReadExt as _, AsyncWriteExt as _},
        net::{TcpListener, TcpStream},
        sync::Semaphore,
    };

    use super::{no_body, serve, Limits};

    /// At the cap with every connection busy answering, a new client waits until one is done
    /// and is then served, rather than being closed (a real scraper arriving while 64 others
    /// waited on one shared encoding was reset).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_arriving_while_every_connection_is_busy_waits_and_is_served() {
        let gate = Arc::new(Semaphore::new(0));
        let held = gate.clone();
        let router = Router::new()
            .route(
                "/slow",
                get(move || {
                    let gate = held.clone();
                    async move {
                        let _pass = gate.acquire().await;
                        "slow\n"
                    }
                }),
            )
            .route("/fast", get(|| async { "fast\n" }));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            max_connections: 2,
            takes_body: no_body,
            ..Limits::default()
        };
        let server = tokio::spawn(serve(listener, router, limits, "test"));
        let request =
            |path: &str| format!("GET {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n");
        let mut busy = Vec::new();
        for _ in 0..2 {
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(request("/slow").as_bytes()).await.unwrap();
            busy.push(c);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut late = TcpStream::connect(addr).await.unwrap();
        late.write_all(request("/fast").as_bytes()).await.unwrap();
        let mut reply = Vec::new();
        let early =
            tokio::time::timeout(Duration::from_millis(300), late.read_to_end(&mut reply)).await;
        assert!(
            early.is_err(),
            "the client arriving at the cap was answered or closed at once: {early:?}, {:?}",
            String::from_utf8_lossy(&reply)
        );
        gate.add_permits(1);
        tokio::time::timeout(Duration::from_secs(5), late.read_to_end(&mut reply))
            .await
            .expect("served once a connection was done")
            .unwrap();
        let text = String::from_utf8_lossy(&reply);
        assert!(
            text.starts_with("HTTP/1.1 200") && text.ends_with("fast\n"),
            "{text}"
        );
        gate.add_permits(1);
        server.abort();
    }
}
