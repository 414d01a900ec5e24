//! The control API's HTTP layer: the input is one client's byte stream, sent over an in-memory
//! connection into the real `http::serve` (hyper's HTTP/1 connection, the body limit) and the
//! real `api::router`, over `api::harness::Recorder`, a backend that records what the handlers
//! ask of it (the agent itself needs root and a loaded XDP program). Each input is sent twice:
//! once with the client waiting for its answers before it shuts its side down, once shutting it
//! down at once (hyper's end-of-file paths).
//!
//! `api::harness::check` then holds the exchange to what must hold whatever the client sends:
//! every answer an HTTP/1.x response with a status the API can give (never a 500), every 2xx a
//! JSON object, every 4xx the API's `{"error": MESSAGE}` or the text of `http::serve`'s body
//! limits or hyper's empty answer to what it cannot parse; no more answers and backend calls
//! than request heads in the input; the backend only called with validated values (`top`'s
//! `n`, `interval_ms` and `limit` in bounds, a rule that compiles, `explain`'s port and flags
//! only with their protocol); and every backend answer delivered, in order.
//!
//! The runtime runs on tokio's paused clock: nothing waits on a real timer, and a stall is
//! reported at once.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use ratelimit::api::harness::{check, exchange, Close};

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    for close in [Close::WhenIdle, Close::AtOnce] {
        let x = runtime().block_on(exchange(data, close));
        if let Err(e) = check(&x) {
            panic!(
                "{e}\nclose: {close:?}\ninput: {:?}\noutput: {:?}\ncalls: {:?}",
                String::from_utf8_lossy(&x.input),
                String::from_utf8_lossy(&x.output),
                x.calls
            );
        }
    }
});
