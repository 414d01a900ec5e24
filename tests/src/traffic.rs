//! Paced UDP senders: a socket bound to a chosen source address inside a namespace, and a loop
//! that sends numbered datagrams from it at a steady packets-per-second rate.

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use socket2::{Domain, Protocol, Socket, Type};

use crate::netns::{in_netns, next_id, Netns};
use crate::wire::{Header, HEADER_LEN};

/// How far behind schedule the sender may fall (after a preemption, say) and still catch up by
/// sending the missed packets back to back: 2 ms worth of packets, and at least
/// [`MIN_LAG_PACKETS`]. Slots further behind are skipped (and counted), not crammed into one burst
/// that a rate limiter would rightly cut.
const MAX_LAG: Duration = Duration::from_millis(2);
/// See [`MAX_LAG`]; keeps a low-rate sender from skipping on every scheduler hiccup.
const MIN_LAG_PACKETS: u64 = 8;

/// What [`send_udp`] did.
#[derive(Clone, Copy, Debug)]
pub struct SendReport {
    /// Datagrams the kernel accepted.
    pub sent: u64,
    /// Schedule slots skipped because the sender fell too far behind (CPU starvation): more than
    /// 2 ms and more than 8 packets. Compare what arrived with `sent`, not with `pps * duration`.
    pub skipped: u64,
    /// Sends that failed with a transient error (`ENOBUFS`, `EAGAIN`, `ECONNREFUSED`).
    pub errors: u64,
    /// The sender id carried in every datagram's header.
    pub sender: u64,
    /// Just before the first send.
    pub first: Instant,
    /// Just after the last send.
    pub last: Instant,
}

impl SendReport {
    /// The achieved rate, packets per second, between the first and the last send.
    pub fn achieved_pps(&self) -> f64 {
        let secs = (self.last - self.first).as_secs_f64();
        if self.sent < 2 || secs == 0.0 {
            return 0.0;
        }
        (self.sent - 1) as f64 / secs
    }
}

/// A UDP socket created in `ns` and bound to `src` (port 0 picks one). The address must be
/// configured in `ns`; see [`bind_udp_transparent`] for any address. Usable from any thread.
pub fn bind_udp(ns: &Netns, src: SocketAddr) -> Result<UdpSocket> {
    bind(ns, src, false)
}

/// Like [`bind_udp`], but with `IP_TRANSPARENT`/`IPV6_TRANSPARENT` set, so `src` may be any
/// address, configured or not: one interface can send as a whole prefix of sources (or spoofed
/// ones) without adding each address. Needs `CAP_NET_ADMIN`.
pub fn bind_udp_transparent(ns: &Netns, src: SocketAddr) -> Result<UdpSocket> {
    bind(ns, src, true)
}

fn bind(ns: &Netns, src: SocketAddr, transparent: bool) -> Result<UdpSocket> {
    in_netns(ns, || -> io::Result<UdpSocket> {
        let socket = Socket::new(Domain::for_address(src), Type::DGRAM, Some(Protocol::UDP))?;
        if transparent {
            let (level, name) = match src {
                SocketAddr::V4(_) => (libc::SOL_IP, libc::IP_TRANSPARENT),
                SocketAddr::V6(_) => (libc::SOL_IPV6, libc::IPV6_TRANSPARENT),
            };
            crate::set_int_opt(&socket, level, name, 1)?;
        }
        socket.bind(&src.into())?;
        Ok(socket.into())
    })
    .with_context(|| format!("binding a UDP socket to {src} in namespace {}", ns.name()))
}

/// Sends datagrams of `payload_len` bytes from `socket` to `dst` at `pps` packets per second for
/// `duration`: `pps * duration` packets when the CPU keeps up.
///
/// Each payload starts with a [`Header`] (this call's sender id and a sequence number from 0), so
/// `payload_len` is at least [`HEADER_LEN`]. Pacing sleeps until the next packet is due and then
/// sends every packet that is due, so the batch size adapts to the sleep granularity (about 60 us):
/// one packet at a time at a few thousand pps, a few back to back at 50,000 pps.
pub fn send_udp(
    socket: &UdpSocket,
    dst: SocketAddr,
    pps: u64,
    duration: Duration,
    payload_len: usize,
) -> Result<SendReport> {
    if payload_len < HEADER_LEN {
        bail!("payload_len {payload_len}: want at least {HEADER_LEN} bytes for the header");
    }
    if pps == 0 {
        bail!("pps must be positive");
    }
    let sender = u64::from(std::process::id()) << 32 | (next_id() & 0xffff_ffff);
    let total = u64::try_from(duration.as_nanos() * u128::from(pps) / 1_000_000_000)
        .context("pps * duration overflows")?;
    let slot_time = |slot: u64| {
        Duration::from_nanos(
            u64::try_from(u128::from(slot) * 1_000_000_000 / u128::from(pps)).unwrap_or(u64::MAX),
        )
    };
    let max_lag = (u128::from(pps) * MAX_LAG.as_nanos() / 1_000_000_000)
        .max(u128::from(MIN_LAG_PACKETS)) as u64;

    let mut payload = vec![0u8; payload_len];
    let mut report = SendReport {
        sent: 0,
        skipped: 0,
        errors: 0,
        sender,
        first: Instant::now(),
        last: Instant::now(),
    };
    let start = report.first;
    let mut slot = 0u64; // next schedule slot; slot n is due at start + n / pps
    while slot < total {
        let elapsed = start.elapsed();
        let due = (u64::try_from(elapsed.as_nanos() * u128::from(pps) / 1_000_000_000)
            .unwrap_or(u64::MAX)
            .saturating_add(1))
        .min(total);
        if due > slot + max_lag {
            report.skipped += due - max_lag - slot;
            slot = due - max_lag;
        }
        while slot < due {
            Header {
                sender,
                seq: report.sent,
            }
            .write(&mut payload);
            match socket.send_to(&payload, dst) {
                Ok(_) => report.sent += 1,
                Err(e) if is_transient(&e) => report.errors += 1,
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("sending to {dst} from {:?}", socket.local_addr().ok())
                    })
                }
            }
            slot += 1;
        }
        report.last = Instant::now();
        if slot < total {
            if let Some(wait) = slot_time(slot).checked_sub(start.elapsed()) {
                thread::sleep(wait);
            }
        }
    }
    Ok(report)
}

/// Binds a socket to `src` in `ns` ([`bind_udp`]) and runs [`send_udp`] from it on this thread.
pub fn send_udp_from(
    ns: &Netns,
    src: SocketAddr,
    dst: SocketAddr,
    pps: u64,
    duration: Duration,
    payload_len: usize,
) -> Result<SendReport> {
    send_udp(&bind_udp(ns, src)?, dst, pps, duration, payload_len)
}

fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOBUFS | libc::EAGAIN | libc::ECONNREFUSED)
    )
}

/// How much later (or earlier, relative to each other) the program may see the first and the
/// last packet of a send than the sender's clock says: veth delivery and softirq scheduling on a
/// loaded 2-core machine.
pub const SKEW_SECS: f64 = 0.05;
/// How far the coarse clock the program uses for these rules lags (one jiffy, 4 ms at HZ=250).
pub const JIFFY_SECS: f64 = 0.004;

/// Received count of a source whose bucket starts full (a new bucket or a refilled one) against
/// what its token bucket admits over the send's duration t (the sender's first to last packet),
/// `burst + rate x t`, with only the tolerances timing makes necessary:
/// - above: `rate x SKEW_SECS` (the program's window may be that much longer) and one token that
///   comes due between two packets;
/// - below: the same, plus `rate x JIFFY_SECS` (a lagging clock refills later), plus the refill
///   lost while the sender was stalled (`skipped` slots, `skipped / pps` seconds, during which a
///   bucket at its burst stops filling).
///
/// A limiter that started sources empty (no burst), or let more than the burst through, fails.
/// Prints the figures it checks.
#[expect(clippy::cast_precision_loss, reason = "small counts")]
pub fn assert_limited(what: &str, sent: &SendReport, got: u64, rate: u64, burst: u64) {
    let t = (sent.last - sent.first).as_secs_f64();
    let rate_f = rate as f64;
    let stalled = sent.skipped as f64 / sent.achieved_pps().max(1.0);
    let exact = burst as f64 + rate_f * t;
    let (low, high) = (
        exact - rate_f * (SKEW_SECS + JIFFY_SECS + stalled) - 1.0,
        exact + rate_f * SKEW_SECS + 1.0,
    );
    println!(
        "{what}: sent {} (skipped {}), received {got}, bucket admits {exact:.1} ({low:.1}..{high:.1})",
        sent.sent, sent.skipped
    );
    assert!(
        sent.sent as f64 >= 2.0 * high,
        "{what}: only {} sent against a bucket of {high:.0}: too slow to test the limit",
        sent.sent
    );
    assert!(
        (low..=high).contains(&(got as f64)),
        "{what}: received {got} of {}, want {low:.1}..{high:.1} (burst {burst} + {rate}/s x {t:.3} s)",
        sent.sent
    );
}
