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
    ratelimit_testbed::packet::eth()
        .macs(src_mac, dst_mac)
        .ipv4(src, dst)
        .ipv4_checksum()
        .udp(40_000, 9)
        .pad_to(FRAME_LEN)
        .build()
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

/// Random bits of the known-source generator: 2^19 sources (`RANDOM_NET.0-7.x.x`), half of a
/// table of 2^20, so no contender's table fills and every source comes back many times.
pub const KNOWN_BITS: u32 = 19;

/// The known-source generator: [`load_random_source`] over [`KNOWN_BITS`] bits.
pub fn load_known_source(pin_dir: &Path) -> Result<Xdp> {
    crate::progs::load(
        "bench_tx_known",
        &crate::progs::random_source_bits(KNOWN_BITS),
        pin_dir,
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The frame the random-source generator rewrites: the addresses where the program and the
    /// receiving interface look, IP ID 0 (the generator's checksum trick needs it) and a header
    /// checksum the receiving stack accepts (the header's words sum to 0xffff).
    #[test]
    fn the_udp_frame_has_its_addresses_and_a_valid_header_checksum() {
        let (dst_mac, src_mac) = ([2, 0, 0, 0, 0, 2], [2, 0, 0, 0, 0, 1]);
        let f = udp_frame(
            dst_mac,
            src_mac,
            std::net::Ipv4Addr::new(RANDOM_NET, 0, 0, 0),
            std::net::Ipv4Addr::new(198, 18, 0, 2),
        );
        assert_eq!(f.len(), FRAME_LEN);
        assert_eq!((&f[0..6], &f[6..12]), (&dst_mac[..], &src_mac[..]));
        assert_eq!(&f[26..34], &[RANDOM_NET, 0, 0, 0, 198, 18, 0, 2]);
        assert_eq!(&f[18..20], &[0, 0], "IP ID");
        assert_ne!(&f[24..26], &[0, 0], "a checksum is written");
        assert_eq!(ratelimit_testbed::packet::checksum(&f[14..34]), 0);
    }

    /// The known-source generator writes sources of `RANDOM_NET.0-7.x.x` only, all 8 values of
    /// the masked byte come up, and every frame's header checksum stays valid. Would catch a mask
    /// that lets 24 bits through (a source outside /13) or that keeps none (only 2^16 sources).
    #[test]
    fn the_known_generator_draws_from_2_to_the_19_sources_with_valid_checksums() {
        use aya::programs::{TestRun as _, TestRunOptions};
        if ratelimit_testbed::skip_unless_root() {
            return;
        }
        let dir = crate::progs::TestPinDir::new("rlb-known-test");
        let prog = load_known_source(&dir.0).unwrap();
        let frame = udp_frame(
            [2, 0, 0, 0, 0, 2],
            [2, 0, 0, 0, 0, 1],
            std::net::Ipv4Addr::new(RANDOM_NET, 0, 0, 0),
            std::net::Ipv4Addr::new(198, 18, 1, 1),
        );
        let mut seen = [false; 8];
        let mut sources = std::collections::HashSet::new();
        for _ in 0..2000 {
            let mut out = vec![0u8; frame.len()];
            prog.test_run(TestRunOptions {
                data_in: Some(&frame),
                data_out: Some(&mut out),
                ..TestRunOptions::new()
            })
            .unwrap();
            assert_eq!(out[26], RANDOM_NET);
            assert!(out[27] < 8, "source {:?} outside the /13", &out[26..30]);
            seen[usize::from(out[27])] = true;
            sources.insert([out[27], out[28], out[29]]);
            assert_eq!(ratelimit_testbed::packet::checksum(&out[14..34]), 0);
        }
        assert!(seen.iter().all(|&s| s), "masked byte values seen: {seen:?}");
        assert!(
            sources.len() > 1900,
            "{} distinct sources of 2000",
            sources.len()
        );
    }
}
