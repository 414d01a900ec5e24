//! Traffic for the end-to-end runs: an XDP program run by BPF_PROG_TEST_RUN in live-frames mode
//! (BPF_F_TEST_XDP_LIVE_FRAMES) with `ingress_ifindex` set to the sending veth; each XDP_TX sends
//! the frame to the veth's peer, where the program or firewall under test receives it.
//!
//! Two generators: `bench_tx` from the project's object sends one frame again and again (one hot
//! source); the random-source generator rewrites the source address of every frame with a random one first
//! (a spoofed flood). The kernel fills the live-frames page pool with the input frame once and
//! recycles its pages without copying the frame again, so a program that rewrites a field finds
//! its own last write there; the random generator writes the whole field every time.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use aya::programs::{TestRun as _, TestRunAttrs, TestRunOptions, Xdp};
use ratelimit_testbed::{in_netns, Netns};

/// Frames per live-frames batch: the kernel's default (64). After each batch the test run flushes
/// the frames to the peer veth and re-enables bottom halves, so the receiving NAPI poll runs on
/// the same CPU between batches; a batch well under the veth ring (256) loses no frames there.
pub const BATCH: u32 = 64;
/// Frames per BPF_PROG_TEST_RUN call; a call takes some tens of milliseconds.
const FRAMES_PER_CALL: u32 = 1 << 16;
/// Wire length of the generated frames (without FCS): the Ethernet minimum.
pub const FRAME_LEN: usize = 60;

/// The first octet of the random generator's sources: it rewrites the other three (24 bits), so
/// sources repeat rarely within a bucket map of a million. Not the RFC 2544 benchmarking range
/// (198.18.0.0/15 has 17 bits); these frames never leave the bench's own namespaces.
pub const RANDOM_NET: u8 = 10;

/// One IPv4/UDP frame from `src` to `dst`, Ethernet addresses `src_mac` -> `dst_mac`, padded to
/// [`FRAME_LEN`], with a correct IPv4 header checksum (the receiving stack checks it; the UDP
/// checksum is left zero, "none", which IPv4 allows).
pub fn udp_frame(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: std::net::Ipv4Addr,
    dst: std::net::Ipv4Addr,
) -> Vec<u8> {
    let mut f = ratelimit_testbed::packet::eth()
        .ipv4(src, dst)
        .udp(40_000, 9)
        .pad_to(FRAME_LEN)
        .build();
    f[0..6].copy_from_slice(&dst_mac);
    f[6..12].copy_from_slice(&src_mac);
    set_ipv4_checksum(&mut f[14..34]);
    f
}

/// Writes the checksum of a 20-byte IPv4 header into it.
pub fn set_ipv4_checksum(h: &mut [u8]) {
    h[10] = 0;
    h[11] = 0;
    let mut sum: u32 = h
        .chunks_exact(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    #[expect(clippy::cast_possible_truncation, reason = "folded to 16 bits above")]
    let csum = !(sum as u16);
    h[10..12].copy_from_slice(&csum.to_be_bytes());
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let bytes: Vec<u8> = s
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad MAC address {s:?}"))?;
    bytes
        .try_into()
        .map_err(|_| anyhow::anyhow!("bad MAC address {s:?}"))
}

/// The random-source generator: XDP bytecode ([`crate::progs::random_source`]) that stores 24
/// random bits in the last three bytes of the IPv4 source address and keeps the header checksum
/// valid by writing the one's complement of their sum into the IP ID field, then returns XDP_TX.
///
/// It expects the frame of [`udp_frame`] with source `RANDOM_NET.0.0.0` and IP ID 0: replacing
/// bytes b1, (b2 b3) of the address adds `s = b1 + b2b3` to the header's one's-complement sum,
/// and an ID of `!s` adds 0xffff, which is zero in one's complement, so the original checksum
/// stays right.
pub fn load_random_source(pin_dir: &Path) -> Result<Xdp> {
    crate::progs::load("bench_tx_random", &crate::progs::random_source(), pin_dir)
}

/// What one timed blast sent.
#[derive(Clone, Copy, Debug)]
pub struct Blast {
    /// Frames the generator ran (each transmitted to the peer, or dropped there when its ring was
    /// full).
    pub frames: u64,
    /// Wall-clock time of the blast.
    pub elapsed: Duration,
}

/// Pins the calling thread to `cpu`.
///
/// The generator and the polite sender run on one CPU, so that the receiving veth's NAPI poll,
/// which runs where it was last scheduled from, always runs there too: a packet sent from another
/// CPU would move it (and the pipeline would straddle two CPUs for a while).
pub fn pin_to_cpu(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity only touch
    // it and the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw const set) != 0 {
            bail!("pinning to CPU {cpu}: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Runs `program` in live-frames mode with `frame` as input, transmitting to the peer of
/// `ifindex` (an interface of `ns`), for about `duration`, on `cpu`.
pub fn blast(
    program: &Xdp,
    ns: &Netns,
    ifindex: u32,
    frame: &[u8],
    duration: Duration,
    cpu: usize,
) -> Result<Blast> {
    // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
    let len = u32::try_from(frame.len()).context("frame length")?;
    let md: [u32; 6] = [0, len, 0, ifindex, 0, 0];
    let ctx: Vec<u8> = md.iter().flat_map(|w| w.to_ne_bytes()).collect();
    // The test run resolves `ingress_ifindex` in the calling thread's network namespace.
    in_netns(ns, || {
        pin_to_cpu(cpu)?;
        let start = Instant::now();
        let mut frames = 0u64;
        while start.elapsed() < duration {
            let opts = TestRunOptions {
                data_in: Some(frame),
                ctx_in: Some(&ctx),
                repeat: FRAMES_PER_CALL,
                attrs: TestRunAttrs::new().xdp_live_frames(BATCH),
                ..TestRunOptions::new()
            };
            program
                .test_run(opts)
                .context("BPF_PROG_TEST_RUN in live-frames mode")?;
            frames += u64::from(FRAMES_PER_CALL);
        }
        Ok(Blast {
            frames,
            elapsed: start.elapsed(),
        })
    })
}
