//! Test bed for `ratelimit`'s root-only integration tests and demo: throwaway network namespaces,
//! veth pairs between them, and real, paced UDP traffic with per-source counting on the far side.
//!
//! # Layout
//! - [`netns`]: [`Netns`] (created with a unique name, deleted on drop), [`in_netns`] to run code
//!   (and create sockets) inside one, [`leftover_check`] to assert that a test cleaned up.
//! - [`link`]: [`veth_pair`], [`add_addr`], static neighbours ([`neigh_to_peer`]), [`ifindex`].
//! - [`traffic`]: [`send_udp`], a paced sender of numbered datagrams, and the sockets it uses.
//! - [`receiver`]: [`Receiver`], counting datagrams per source address on a background thread.
//! - [`packet`]: a frame builder for BPF_PROG_TEST_RUN cases (`eth().vlan(10).ipv4(..).udp(..)`),
//!   and with real MACs and checksums for the wire; [`packet::checksum`] (RFC 1071).
//! - [`raw`]: [`RawSocket`], an `AF_PACKET` socket sending such frames out of an interface, one at a
//!   time or paced ([`RawSocket::send_paced`]).
//! - [`xdp`]: [`TestDataplane`], the real XDP program loaded into the kernel under a throwaway pin
//!   directory, for running frames through it with BPF_PROG_TEST_RUN.
//! - [`bpf_stack`]: the stack of an eBPF object's call chains, from the object (frames and
//!   BPF-to-BPF calls), as the verifier sums it.
//! - [`clock`]: the program's two clocks read from user space (`CLOCK_MONOTONIC` and its coarse
//!   twin, the coarse tick).
//! - [`agent`]: where the real `ratelimit` binary is, for tests that run it as an agent.
//! - [`agent_proc`]: [`AgentProcess`], that binary running as an agent in a test namespace.
//! - [`cli`]: the `ratelimit` CLI against an agent's socket ([`cli()`], [`AgentProcess::cli`],
//!   [`AgentProcess::cli_json`], ...), its status and output.
//! - [`wire`]: the header every test datagram carries (sender id, sequence number).
//! - [`collide`]: sources chosen to collide in the bucket store under a known seed.
//! - [`bursty`]: a sender of back-to-back bursts to several hosts that logs every datagram, and
//!   what one GCRA bucket would admit of them ([`bursty::one_bucket`]).
//! - [`redis`]: [`redis::RedisServer`], a real `redis-server` in a test namespace (for
//!   `backend = "redis"`), killed on drop.
//! - [`redis_local`]: [`redis_local::LocalRedisCluster`], a Redis Cluster of several masters on
//!   loopback in this namespace (the bench's `redis` case), removed on drop.
//! - [`cluster_net`]: [`cluster_net::ClusterNet`], the one cluster test network (a switch with a
//!   data bridge and a gossip bridge, a sender, hosts each with a data link and a gossip link, the
//!   key files), the hosts' configs and agents, paced floods split over the hosts and the
//!   cluster's admitted rate over any window.
//! - [`cluster`]: the agents' cluster status and metrics, [`cluster::wait_for`], and
//!   [`cluster::Attacker`], a key-holding peer speaking the real sealed protocol.
//!
//! Only addresses from the benchmarking range 198.18.0.0/15 and 2001:db8::/32 are meant to be used,
//! and only between namespaces the test created.
//!
//! ```no_run
//! use ratelimit_testbed::*;
//! use std::time::Duration;
//!
//! if skip_unless_root() { return Ok(()); }
//! let (tx, rx) = (Netns::new("rl-doc")?, Netns::new("rl-doc")?);
//! let (tx_if, rx_if) = veth_pair(&tx, &rx, "doc")?;
//! add_addr(&tx, &tx_if, "198.18.0.1/24")?;
//! add_addr(&rx, &rx_if, "198.18.0.254/24")?;
//! neigh_to_peer(&tx, &tx_if, "198.18.0.254".parse()?, &rx, &rx_if)?;
//! let receiver = Receiver::bind(&rx, "198.18.0.254:9000".parse()?)?;
//! let sent = send_udp_from(&tx, "198.18.0.1:0".parse()?, receiver.local_addr(), 1000,
//!                          Duration::from_secs(1), 64)?;
//! receiver.wait_idle(Duration::from_millis(100), Duration::from_secs(2));
//! let got = receiver.stop()?.counts();
//! assert_eq!(got[&"198.18.0.1".parse()?], sent.sent);
//! # Ok::<(), anyhow::Error>(())
//! ```

pub mod agent;
pub mod agent_proc;
pub mod bpf_stack;
pub mod bursty;
pub mod cli;
pub mod clock;
pub mod cluster;
pub mod cluster_net;
mod cmd;
pub mod collide;
pub mod fill;
pub mod late_rounds;
pub mod link;
pub mod metrics;
pub mod netns;
pub mod packet;
pub mod raw;
pub mod receiver;
pub mod redis;
pub mod redis_local;
pub mod traffic;
pub mod wire;
pub mod xdp;

#[cfg(test)]
mod smoke;

pub use agent::agent_binary;
pub use agent_proc::AgentProcess;
pub use cli::{cli, CliOutput};
pub use link::{add_addr, add_neigh, ifindex, mac, mac_bytes, neigh_to_peer, parse_mac, veth_pair};
pub use netns::{assert_none_left, in_netns, leftover_check, netns_exists, Netns};
pub use raw::RawSocket;
pub use receiver::{ReceiveReport, Receiver, SourceStats};
pub use traffic::{
    assert_limited, bind_udp, bind_udp_transparent, send_udp, send_udp_from, SendReport,
    JIFFY_SECS, SKEW_SECS,
};
pub use xdp::TestDataplane;

/// Whether this process runs as root (network namespaces and veth pairs need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// For the first line of a root-only test that cannot mean anything without root (it loads XDP
/// programs or creates namespaces): fails with a message saying so, rather than passing unseen.
pub fn require_root() {
    assert!(
        is_root(),
        "this test needs root (CAP_BPF, CAP_NET_ADMIN): run `cargo xtask test` as root"
    );
}

/// For the first line of a root-only test: prints "skipped: needs root" and returns true when not
/// root, so the test can `return` and pass without doing anything.
pub fn skip_unless_root() -> bool {
    if is_root() {
        return false;
    }
    println!("skipped: needs root");
    true
}

/// `setsockopt` of an `int` option, for the few options socket2 does not wrap.
fn set_int_opt(
    socket: &socket2::Socket,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: the fd is open for the borrow's duration; value and its size describe a valid c_int.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            std::ptr::from_ref(&value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
