//! Scrapes that see everything before them: the agent shares one encoding of `/metrics` among
//! the scrapes of the next second (`ratelimit::metrics::SHARE_FOR`), so a test that reads a
//! counter after sending traffic waits that long past its previous scrape of the same endpoint.

use std::{
    collections::HashMap,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::{in_netns, Netns};

/// When each endpoint (namespace and address) last answered this process.
static LAST: Mutex<Option<HashMap<String, Instant>>> = Mutex::new(None);

/// Runs `scrape` against `endpoint` (a name for the namespace and address) once the share
/// of the previous scrape's encoding has run out, so that its reply is encoded after the call.
pub fn fresh<T>(endpoint: &str, scrape: impl FnOnce() -> T) -> T {
    let wait = ratelimit::metrics::SHARE_FOR + Duration::from_millis(50);
    let last = LAST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_or_insert_with(HashMap::new)
        .get(endpoint)
        .copied();
    if let Some(left) = last.and_then(|t| wait.checked_sub(t.elapsed())) {
        std::thread::sleep(left);
    }
    let out = scrape();
    LAST.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_or_insert_with(HashMap::new)
        .insert(endpoint.to_owned(), Instant::now());
    out
}

/// `GET /metrics` at `addr` from inside `ns`, encoded after the call ([`fresh`]): the whole
/// HTTP response, status line and headers included.
///
/// # Errors
/// When it cannot connect or read.
pub fn get(ns: &Netns, addr: SocketAddr) -> std::io::Result<String> {
    fresh(&format!("{}/{addr}", ns.name()), || {
        in_netns(ns, || {
            let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            stream.set_read_timeout(Some(Duration::from_secs(10)))?;
            write!(
                stream,
                "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nAccept: */*\r\nConnection: close\r\n\r\n"
            )?;
            let mut text = String::new();
            stream.read_to_string(&mut text)?;
            Ok(text)
        })
    })
}
