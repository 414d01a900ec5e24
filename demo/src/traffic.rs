//! The demo's clients: paced UDP senders that count every packet as it leaves, so the live table
//! can show what was sent so far (the test bed's `send_udp` reports only once it has finished).

use std::{
    io,
    net::{IpAddr, SocketAddr, UdpSocket},
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use ratelimit_testbed::{
    bind_udp,
    wire::{Header, HEADER_LEN},
    Netns,
};

/// UDP payload bytes per datagram (the test bed's header and padding).
const PAYLOAD: usize = 64;
const _: () = assert!(PAYLOAD >= HEADER_LEN);
/// How far behind schedule a sender may fall (descheduled on a busy machine) and still catch up
/// back to back: 2 ms worth of packets, at least 8. Slots further behind are skipped and counted,
/// so the polite client never bursts.
const MAX_LAG: Duration = Duration::from_millis(2);
const MIN_LAG_PACKETS: u64 = 8;

/// One client: a socket bound to its own source address in the client namespace.
pub struct Client {
    /// "flood" or "polite".
    pub label: &'static str,
    /// Source address.
    pub addr: IpAddr,
    /// Packets per second asked for.
    pub pps: u64,
    socket: UdpSocket,
    sent: AtomicU64,
    done: AtomicBool,
}

/// What a client did, once it has stopped.
#[derive(Clone, Copy, Debug, Default)]
pub struct Totals {
    /// Datagrams the kernel accepted.
    pub sent: u64,
    /// Schedule slots skipped because the sender fell too far behind.
    pub skipped: u64,
    /// Sends that failed with a transient error (ENOBUFS, EAGAIN).
    pub errors: u64,
    /// First and last send, if any.
    pub span: Option<(Instant, Instant)>,
}

impl Totals {
    /// Time from the first send to the last.
    pub fn duration(&self) -> Duration {
        self.span
            .map_or(Duration::ZERO, |(first, last)| last - first)
    }

    /// Achieved packets per second between the first and the last send.
    #[allow(clippy::cast_precision_loss, reason = "packet counts far below 2^52")]
    pub fn achieved_pps(&self) -> f64 {
        let secs = self.duration().as_secs_f64();
        if self.sent < 2 || secs == 0.0 {
            return 0.0;
        }
        (self.sent - 1) as f64 / secs
    }
}

impl Client {
    /// Binds a UDP socket to `addr` (which must be configured) in `ns`.
    pub fn bind(ns: &Netns, label: &'static str, addr: IpAddr, pps: u64) -> Result<Client> {
        let socket = bind_udp(ns, SocketAddr::new(addr, 0))?;
        Ok(Client {
            label,
            addr,
            pps,
            socket,
            sent: AtomicU64::new(0),
            done: AtomicBool::new(false),
        })
    }

    /// Datagrams sent so far. Counted before each send, so a datagram the receiver has counted is
    /// always counted here too: read the receiver first, then this, and `sent >= received`.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// Whether [`Client::run`] has returned.
    pub fn done(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }

    /// Sends numbered datagrams to `dst` at `self.pps` for `duration`, or until `stop()` says so.
    pub fn run(
        &self,
        dst: SocketAddr,
        duration: Duration,
        stop: &dyn Fn() -> bool,
    ) -> Result<Totals> {
        struct Done<'a>(&'a AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let _done = Done(&self.done);

        let pps = u128::from(self.pps);
        let total = u64::try_from(duration.as_nanos() * pps / 1_000_000_000).unwrap_or(u64::MAX);
        let max_lag = u64::try_from(pps * MAX_LAG.as_nanos() / 1_000_000_000)
            .unwrap_or(u64::MAX)
            .max(MIN_LAG_PACKETS);
        // The receiver tracks sequence numbers per (source address, sender id): one id will do.
        let sender = u64::from(std::process::id()) << 32;
        let mut payload = [0u8; PAYLOAD];
        let mut totals = Totals::default();
        let start = Instant::now();
        let mut slot = 0u64; // next schedule slot: slot n is due at start + n / pps
        while slot < total && !stop() {
            let elapsed = start.elapsed().as_nanos();
            let due = u64::try_from(elapsed * pps / 1_000_000_000)
                .unwrap_or(u64::MAX)
                .saturating_add(1)
                .min(total);
            if due > slot + max_lag {
                totals.skipped += due - max_lag - slot;
                slot = due - max_lag;
            }
            while slot < due {
                Header {
                    sender,
                    seq: totals.sent,
                }
                .write(&mut payload);
                self.sent.fetch_add(1, Ordering::SeqCst);
                match self.socket.send_to(&payload, dst) {
                    Ok(_) => {
                        totals.sent += 1;
                        let now = Instant::now();
                        totals.span = Some((totals.span.map_or(now, |(first, _)| first), now));
                    }
                    Err(e) => {
                        self.sent.fetch_sub(1, Ordering::SeqCst);
                        if !is_transient(&e) {
                            return Err(e).with_context(|| {
                                format!(
                                    "{} client: sending from {} to {dst}",
                                    self.label, self.addr
                                )
                            });
                        }
                        totals.errors += 1;
                    }
                }
                slot += 1;
            }
            if slot < total {
                let next = Duration::from_nanos(
                    u64::try_from(u128::from(slot) * 1_000_000_000 / pps).unwrap_or(u64::MAX),
                );
                if let Some(wait) = next.checked_sub(start.elapsed()) {
                    thread::sleep(wait);
                }
            }
        }
        Ok(totals)
    }
}

/// A send error that says "not now" (full queue) rather than "never": count it and go on.
fn is_transient(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN))
}
