//! A UDP receiver in a namespace that counts datagrams per source address on a background thread,
//! readable live (for a demo's display) and final after [`Receiver::stop`].

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{anyhow, bail, Context, Result};
use socket2::{Domain, Protocol, Socket, Type};

use crate::netns::{in_netns, in_netns_at, Netns};
use crate::wire::Header;

/// Receive buffer asked for: about 0.8 s of 10,000 pps of small datagrams (each costs ~1 KiB of
/// buffer accounting), so a briefly descheduled receiver thread loses nothing.
const RCVBUF: usize = 8 << 20;
/// How often the receiving thread wakes up to look at the stop flag.
const POLL: Duration = Duration::from_millis(20);
/// Duplicate detection tracks sequence numbers below this per sender (a 2 MiB bitmap at most).
const MAX_TRACKED_SEQ: u64 = 1 << 24;
/// A datagram read this long or longer after the kernel received it tells of a stall of the
/// receiving thread: see [`Receiver::stalls`].
pub const STALL: Duration = Duration::from_millis(30);
/// `SIOCGSTAMPNS`: the kernel's receive time of the last datagram read from the socket, a
/// `timespec` of `CLOCK_REALTIME` (the first call turns the socket's timestamps on). The generic
/// value, x86-64's and arm64's (the libc crate does not export it).
const SIOCGSTAMPNS: libc::c_ulong = 0x8907;

/// What arrived from one source address.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceStats {
    /// Datagrams received, ours or not.
    pub packets: u64,
    /// Payload bytes received.
    pub bytes: u64,
    /// Datagrams whose (sender id, sequence number) had already arrived.
    pub duplicates: u64,
    /// Datagrams without our [`Header`] (someone else's traffic).
    pub foreign: u64,
}

/// Final tally of a [`Receiver`].
#[derive(Clone, Debug, Default)]
pub struct ReceiveReport {
    /// Per source address; IPv4-mapped IPv6 sources are reported as IPv4.
    pub sources: HashMap<IpAddr, SourceStats>,
    /// Datagrams the kernel dropped at this socket (receive buffer full), when it could be read.
    pub socket_drops: Option<u64>,
}

impl ReceiveReport {
    /// Packets per source address.
    pub fn counts(&self) -> HashMap<IpAddr, u64> {
        counts(&self.sources)
    }

    /// Packets from all sources.
    pub fn total(&self) -> u64 {
        self.sources.values().map(|s| s.packets).sum()
    }
}

#[derive(Default)]
struct Tally {
    sources: HashMap<IpAddr, SourceStats>,
    /// Bitmap of sequence numbers seen, per (source, sender id).
    seen: HashMap<(IpAddr, u64), Vec<u64>>,
    total: u64,
}

impl Tally {
    fn record(&mut self, from: IpAddr, payload: &[u8]) {
        self.total += 1;
        let stats = self.sources.entry(from).or_default();
        stats.packets += 1;
        stats.bytes += payload.len() as u64;
        let Some(header) = Header::read(payload) else {
            stats.foreign += 1;
            return;
        };
        if header.seq >= MAX_TRACKED_SEQ {
            return;
        }
        let bits = self.seen.entry((from, header.sender)).or_default();
        let (word, bit) = ((header.seq / 64) as usize, header.seq % 64);
        if bits.len() <= word {
            bits.resize(word + 1, 0);
        }
        if bits[word] & (1 << bit) != 0 {
            stats.duplicates += 1;
        }
        bits[word] |= 1 << bit;
    }
}

struct Shared {
    stop: AtomicBool,
    tally: Mutex<Tally>,
    /// See [`Receiver::stalls`]; `None` where not watched (see [`Receiver::bind_watching_stalls`]).
    stalls: Option<Mutex<Vec<(Instant, Duration)>>>,
}

impl Shared {
    fn new(watch_stalls: bool) -> Self {
        Self {
            stop: AtomicBool::new(false),
            tally: Mutex::new(Tally::default()),
            stalls: watch_stalls.then(|| Mutex::new(Vec::new())),
        }
    }

    fn tally(&self) -> MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A UDP socket in a namespace, read by a background thread that counts datagrams per source.
///
/// Dropping it stops the thread; [`Receiver::stop`] does the same and returns the final tally.
pub struct Receiver {
    local: SocketAddr,
    inode: u64,
    netns: PathBuf,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<io::Result<()>>>,
}

impl Receiver {
    /// Binds `addr` in `ns` (port 0 picks a free port, see [`Receiver::local_addr`]) with an 8 MiB
    /// receive buffer and starts counting. `[::]:port` receives IPv4 and IPv6 alike.
    pub fn bind(ns: &Netns, addr: SocketAddr) -> Result<Receiver> {
        Self::bind_with(ns, addr, false)
    }

    /// [`Receiver::bind`], also keeping [`Receiver::stalls`]: one more system call per datagram
    /// (its receive time), for the tests that read rates over short windows.
    pub fn bind_watching_stalls(ns: &Netns, addr: SocketAddr) -> Result<Receiver> {
        Self::bind_with(ns, addr, true)
    }

    fn bind_with(ns: &Netns, addr: SocketAddr, watch_stalls: bool) -> Result<Receiver> {
        let socket = in_netns(ns, || open(addr, watch_stalls))
            .with_context(|| format!("binding receiver to {addr} in namespace {}", ns.name()))?;
        let local = socket.local_addr()?;
        let inode = socket_inode(&socket)?;
        let shared = Arc::new(Shared::new(watch_stalls));
        let thread = thread::Builder::new()
            .name(format!("receiver-{local}"))
            .spawn({
                let shared = Arc::clone(&shared);
                move || receive(&socket, &shared)
            })?;
        Ok(Receiver {
            local,
            inode,
            netns: ns.path(),
            shared,
            thread: Some(thread),
        })
    }

    /// The bound address, with the port the kernel picked.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Packets per source address so far.
    pub fn counts(&self) -> HashMap<IpAddr, u64> {
        counts(&self.shared.tally().sources)
    }

    /// Everything per source address so far.
    pub fn stats(&self) -> HashMap<IpAddr, SourceStats> {
        self.shared.tally().sources.clone()
    }

    /// Packets from all sources so far.
    pub fn total(&self) -> u64 {
        self.shared.tally().total
    }

    /// The sequence numbers (below 2^24) that arrived so far from `from` with the [`Header`]'s
    /// sender id `sender`, ascending: which of a sender's datagrams got through.
    pub fn seqs(&self, from: IpAddr, sender: u64) -> Vec<u64> {
        let tally = self.shared.tally();
        let Some(bits) = tally.seen.get(&(from, sender)) else {
            return Vec::new();
        };
        let mut seqs = Vec::new();
        for (w, &word) in (0u64..).zip(bits) {
            for b in 0..64 {
                if word & (1 << b) != 0 {
                    seqs.push(w * 64 + b);
                }
            }
        }
        seqs
    }

    /// When datagrams waited in the socket for [`STALL`] or longer before the receiving thread
    /// read them (it was descheduled, or the whole machine paused), and for how long: from the
    /// kernel's receive time of the first such datagram to its reading, merged where they
    /// overlap. A count read in such a time is short by what arrived in it, so a rate between
    /// two reads shows the stall as a dip then a rise that the traffic never had.
    ///
    /// Always empty for a receiver made by [`Receiver::bind`], which does not watch.
    pub fn stalls(&self) -> Vec<(Instant, Duration)> {
        self.shared.stalls.as_ref().map_or_else(Vec::new, |s| {
            s.lock().unwrap_or_else(|e| e.into_inner()).clone()
        })
    }

    /// Waits until no packet has arrived for `quiet` (or `timeout` passed) and returns the total:
    /// call it after the senders finish, so packets still in flight get counted.
    pub fn wait_idle(&self, quiet: Duration, timeout: Duration) -> u64 {
        let deadline = Instant::now() + timeout;
        let mut last = self.total();
        let mut since = Instant::now();
        while Instant::now() < deadline {
            thread::sleep(POLL.min(quiet));
            let now = self.total();
            if now != last {
                last = now;
                since = Instant::now();
            } else if since.elapsed() >= quiet {
                break;
            }
        }
        last
    }

    /// Datagrams the kernel dropped at this socket because its receive buffer was full (the
    /// `drops` column of `/proc/net/udp[6]`). Tells a receiver overrun from a real drop.
    pub fn socket_drops(&self) -> Result<u64> {
        let file = match self.local {
            SocketAddr::V4(_) => "/proc/thread-self/net/udp",
            SocketAddr::V6(_) => "/proc/thread-self/net/udp6",
        };
        // /proc/thread-self/net shows the reading thread's namespace.
        let table = in_netns_at(&self.netns, || std::fs::read_to_string(file))
            .with_context(|| format!("reading {file}"))?;
        table
            .lines()
            .skip(1)
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .find(|cols| cols.get(9).and_then(|c| c.parse().ok()) == Some(self.inode))
            .and_then(|cols| cols.get(12)?.parse().ok())
            .ok_or_else(|| anyhow!("socket inode {} not found in {file}", self.inode))
    }

    /// Stops counting (after reading what is already queued) and returns the final tally.
    pub fn stop(mut self) -> Result<ReceiveReport> {
        let socket_drops = self.socket_drops().ok();
        self.join()?;
        Ok(ReceiveReport {
            sources: self.stats(),
            socket_drops,
        })
    }

    fn join(&mut self) -> Result<()> {
        self.shared.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(JoinHandle::join) {
            None => Ok(()),
            Some(Ok(result)) => result.context("receiver thread"),
            Some(Err(_)) => bail!("receiver thread panicked"),
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if let Err(e) = self.join() {
            eprintln!("ratelimit-testbed: {e:#}");
        }
    }
}

fn open(addr: SocketAddr, watch_stalls: bool) -> io::Result<UdpSocket> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        socket.set_only_v6(false)?;
    }
    // SO_RCVBUFFORCE (root) ignores net.core.rmem_max, which would cap SO_RCVBUF at ~200 KiB.
    let rcvbuf = i32::try_from(RCVBUF).unwrap_or(i32::MAX);
    if crate::set_int_opt(&socket, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, rcvbuf).is_err() {
        socket.set_recv_buffer_size(RCVBUF)?;
    }
    socket.set_read_timeout(Some(POLL))?;
    socket.bind(&addr.into())?;
    let socket: UdpSocket = socket.into();
    if watch_stalls {
        // Turns the kernel's receive timestamps on (no datagram yet: `None`).
        let _ = received_at(&socket);
    }
    Ok(socket)
}

/// The kernel's receive time of the datagram last read from `socket` (`None` if it has none).
fn received_at(socket: &UdpSocket) -> Option<SystemTime> {
    use std::os::fd::AsRawFd;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: SIOCGSTAMPNS writes one timespec to the pointer given, a live local.
    let r = unsafe { libc::ioctl(socket.as_raw_fd(), SIOCGSTAMPNS, &raw mut ts) };
    if r != 0 {
        return None;
    }
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let nanos = u32::try_from(ts.tv_nsec).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
}

/// Keeps a stall (see [`Receiver::stalls`]) if the datagram just read from `socket` waited
/// [`STALL`] or longer.
fn note_wait(socket: &UdpSocket, shared: &Shared) {
    let Some(stalls) = &shared.stalls else {
        return;
    };
    let Some(wait) = received_at(socket).and_then(|t| SystemTime::now().duration_since(t).ok())
    else {
        return;
    };
    if wait < STALL {
        return;
    }
    let now = Instant::now();
    let from = now.checked_sub(wait).unwrap_or(now);
    let mut stalls = stalls.lock().unwrap_or_else(|e| e.into_inner());
    match stalls.last_mut() {
        // The same backlog, read on: one stall, from its first datagram's arrival.
        Some((at, len)) if *at + *len >= from => *len = now.duration_since(*at),
        _ => stalls.push((from, wait)),
    }
}

fn receive(socket: &UdpSocket, shared: &Shared) -> io::Result<()> {
    let mut buf = vec![0u8; 65536];
    let mut draining = false;
    loop {
        match socket.recv_from(&mut buf) {
            Ok((n, from)) => {
                note_wait(socket, shared);
                shared.tally().record(from.ip().to_canonical(), &buf[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if draining {
                    return Ok(());
                }
            }
            Err(e) => return Err(e),
        }
        if !draining && shared.stop.load(Ordering::Relaxed) {
            // Count what is already queued, then stop at the first empty read.
            socket.set_nonblocking(true)?;
            draining = true;
        }
    }
}

fn counts(sources: &HashMap<IpAddr, SourceStats>) -> HashMap<IpAddr, u64> {
    sources.iter().map(|(ip, s)| (*ip, s.packets)).collect()
}

/// The socket's inode number, which `/proc/net/udp` lists it by.
fn socket_inode(socket: &UdpSocket) -> Result<u64> {
    use std::os::fd::AsRawFd;
    let link = std::fs::read_link(format!("/proc/self/fd/{}", socket.as_raw_fd()))?;
    let link = link.to_string_lossy();
    link.strip_prefix("socket:[")
        .and_then(|rest| rest.strip_suffix(']'))
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| anyhow!("unexpected socket fd link {link}"))
}

#[cfg(test)]
mod tests {
    use std::net::UdpSocket;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::thread;
    use std::time::Duration;

    use super::{open, receive, Shared, STALL};

    /// Datagrams sent on loopback to a receiving thread that is held (its tally locked by the
    /// test) for `hold` after it read the first one, then ten more at its own pace: the stalls
    /// it reports.
    fn stalls_when_held_for(hold: Duration) -> Vec<Duration> {
        let socket = open("127.0.0.1:0".parse().unwrap(), true).unwrap();
        let to = socket.local_addr().unwrap();
        let shared = Arc::new(Shared::new(true));
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let held = shared.tally();
        let reader = thread::spawn({
            let shared = Arc::clone(&shared);
            move || receive(&socket, &shared)
        });
        // The first is read, and the thread stops at the tally; the next four wait for it.
        tx.send_to(b"x", to).unwrap();
        thread::sleep(Duration::from_millis(2));
        for _ in 0..4 {
            tx.send_to(b"x", to).unwrap();
        }
        thread::sleep(hold);
        drop(held);
        for _ in 0..10 {
            tx.send_to(b"x", to).unwrap();
            thread::sleep(Duration::from_millis(5));
        }
        thread::sleep(Duration::from_millis(50));
        shared.stop.store(true, Ordering::Relaxed);
        reader.join().unwrap().unwrap();
        assert_eq!(shared.tally().total, 15, "every datagram counted");
        let stalls = shared.stalls.as_ref().unwrap().lock().unwrap().clone();
        stalls.into_iter().map(|(_, len)| len).collect()
    }

    #[test]
    fn datagrams_read_late_are_a_stall_as_long_as_they_waited() {
        let start = std::time::Instant::now();
        let stalls = stalls_when_held_for(Duration::from_millis(200));
        let longest = stalls.iter().max().copied().unwrap_or_default();
        assert!(
            longest >= Duration::from_millis(180) && longest <= start.elapsed(),
            "{stalls:?}"
        );
    }

    #[test]
    fn datagrams_read_at_once_are_no_stall() {
        // Held for less than a datagram may wait unremarked. A busy machine can stall the
        // thread for real (then it is reported, rightly): three tries.
        let tries: Vec<_> = (0..3).map(|_| stalls_when_held_for(STALL / 3)).collect();
        assert!(tries.iter().any(Vec::is_empty), "{tries:?}");
    }
}
