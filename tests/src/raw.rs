//! Crafted frames on the wire: an `AF_PACKET` socket that sends whole Ethernet frames (built with
//! [`crate::packet`]: `eth().macs(..).ipv4(..).tcp(..).checksums()`) out of one interface, one at
//! a time or paced at a steady rate, for what a socket cannot send (spoofed sources, SYNs
//! without a connection, fragments cut by hand).

use std::io;
use std::mem;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::netns::{in_netns, Netns};
use crate::traffic::SendReport;

/// An `AF_PACKET` raw socket that sends frames out of one interface to one destination MAC. It
/// receives nothing (protocol 0); its descriptor is closed when it is dropped.
#[derive(Debug)]
pub struct RawSocket {
    fd: OwnedFd,
    addr: libc::sockaddr_ll,
}

impl RawSocket {
    /// Opens the socket in the calling thread's network namespace (inside [`in_netns`]), sending
    /// out of the interface `ifindex` of that namespace to `dst_mac`. The socket stays in that
    /// namespace: it may be used from any thread afterwards. Needs `CAP_NET_RAW`.
    pub fn open(ifindex: u32, dst_mac: [u8; 6]) -> Result<RawSocket> {
        // SAFETY: socket has no memory-safety preconditions.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("opening an AF_PACKET socket");
        }
        // SAFETY: fd is a descriptor just opened and owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_ll is plain data, for which all zeroes is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { mem::zeroed() };
        addr.sll_family = u16::try_from(libc::AF_PACKET).expect("AF_PACKET fits");
        addr.sll_ifindex = i32::try_from(ifindex)
            .with_context(|| format!("interface index {ifindex} out of range"))?;
        addr.sll_halen = 6;
        addr.sll_addr[..6].copy_from_slice(&dst_mac);
        Ok(RawSocket { fd, addr })
    }

    /// [`RawSocket::open`] in `ns` (from any thread).
    pub fn open_in(ns: &Netns, ifindex: u32, dst_mac: [u8; 6]) -> Result<RawSocket> {
        in_netns(ns, || RawSocket::open(ifindex, dst_mac))
            .with_context(|| format!("on interface {ifindex} of namespace {}", ns.name()))
    }

    /// Sends one frame whole (the Ethernet header included).
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: the descriptor is open while self lives; frame and addr are valid for the
        // lengths passed.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&raw const self.addr).cast(),
                libc::socklen_t::try_from(mem::size_of::<libc::sockaddr_ll>())
                    .expect("sockaddr_ll fits"),
            )
        };
        match usize::try_from(n) {
            Ok(n) if n == frame.len() => Ok(()),
            Ok(n) => Err(io::Error::other(format!(
                "sent {n} of a {}-byte frame",
                frame.len()
            ))),
            Err(_) => Err(io::Error::last_os_error()),
        }
    }

    /// Sends `frames` round-robin at `pps` for `duration`: the n-th frame at n / `pps` seconds
    /// after the start, late ones back to back (nothing is skipped). A send that fails for want
    /// of buffer space (`ENOBUFS`, `EAGAIN`) is counted in `errors`; any other error ends it.
    /// `first` is the start, `last` just after the last frame sent, `sender` 0.
    #[expect(clippy::cast_precision_loss, reason = "packet counts")]
    pub fn send_paced(
        &self,
        frames: &[Vec<u8>],
        pps: u64,
        duration: Duration,
    ) -> Result<SendReport> {
        if frames.is_empty() || pps == 0 {
            bail!("send_paced: want frames and a positive rate");
        }
        let start = Instant::now();
        let mut report = SendReport {
            sent: 0,
            skipped: 0,
            errors: 0,
            sender: 0,
            first: start,
            last: start,
        };
        let (mut n, mut next) = (0u64, 0usize);
        while start.elapsed() < duration {
            let due = start + Duration::from_secs_f64(n as f64 / pps as f64);
            let now = Instant::now();
            if now < due {
                thread::sleep(due - now);
            }
            let frame = &frames[next];
            next = (next + 1) % frames.len();
            n += 1;
            match self.send(frame) {
                Ok(()) => {
                    report.sent += 1;
                    report.last = Instant::now();
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN)) => {
                    report.errors += 1;
                }
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("sending frame {n} on interface {}", self.addr.sll_ifindex)
                    })
                }
            }
        }
        Ok(report)
    }
}
